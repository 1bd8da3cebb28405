/* The compiled half of unwind mode's flood path: a poll's hit records -> TraceSamples.
 *
 * Why C: a repeated context (a "hit": the header-only record BPF sends for a context it has seen)
 * had ~5 us of Python for everything at the 200,000 samples/s target, and building its
 * TraceSample (a dataclass __init__ of 11 fields, ~0.8 us) plus the loop around it took half.
 * This does what ModeBase._poll_decoded does with UnwindMode._sample for a batch made only of
 * hit headers (the tuples UnwindSampler.take() returns): look up the context by its key, take the
 * decoded frames, cut the argument words to the syscall's count, and fill each TraceSample's slots
 * directly.  Anything else (a batch with a new or plain record) returns None and goes the Python
 * way, which stays the reference: tests/test_unwind_units.py compares the two on the same records.
 *
 * prepare(TraceSample, field_names): where each field's slot is (once, at import).
 * hit_samples(raw, contexts, info, info_fn, offset, lost_decoded) -> None | (samples, seen, lost,
 *   incomplete): ``contexts`` KernelCounts' {key: (context, decoded)}, ``info`` SYSCALL_INFO
 *   ({nr: (name, argument words)}), ``info_fn(nr)`` fills it; ``incomplete``: the Decoded of each
 *   incomplete sample, in order (the caller tallies their reasons).
 * Built by scripts/build_ext.sh (run by scripts/setup.sh); mode.py falls back without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

enum { F_TIME, F_PID, F_TID, F_EVENT, F_SYSCALL, F_COMPLETE, F_FRAMES, F_ARGS, F_RAW, F_RETURNED, F_RET, NFIELDS };
/* HitHeader indices (sampler.py: HIT_*) */
enum { H_TIME = 0, H_TGID = 2, H_TID = 3, H_NR = 4, H_KEY1 = 9, H_KEY2 = 10, H_ARGS = 13, H_LEN = 19 };

static PyTypeObject *sample_type;
static Py_ssize_t offsets[NFIELDS];
static PyObject *s_complete, *s_json_frames, *s_cpu, *s_syscall;

static PyObject *prepare(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != NFIELDS) {
        PyErr_SetString(PyExc_TypeError, "prepare(TraceSample, its 11 field names in order)");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)args[0];
    for (Py_ssize_t i = 0; i < NFIELDS; i++) {
        PyObject *d = PyObject_GetAttr((PyObject *)t, PyTuple_GET_ITEM(args[1], i));
        if (!d)
            return NULL;
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (ok)
            offsets[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "prepare: a field is not an object slot");
            return NULL;
        }
    }
    Py_XSETREF(sample_type, (PyTypeObject *)Py_NewRef(t));
    Py_RETURN_NONE;
}

static inline void set_slot(PyObject *o, int field, PyObject *v)
{
    *(PyObject **)((char *)o + offsets[field]) = Py_NewRef(v);
}

static PyObject *hit_samples(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "hit_samples(raw, contexts, info, info_fn, offset, lost_decoded)");
        return NULL;
    }
    if (!sample_type) {
        PyErr_SetString(PyExc_RuntimeError, "hit_samples: prepare() first");
        return NULL;
    }
    PyObject *raw = args[0], *contexts = args[1], *info = args[2], *info_fn = args[3], *offset = args[4],
             *lost_decoded = args[5];
    Py_ssize_t n = PyList_GET_SIZE(raw);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(raw, i);
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != H_LEN)
            Py_RETURN_NONE; /* not all hit headers: the Python loop */
    }
    PyObject *out = PyList_New(n), *incomplete = PyList_New(0);
    PyObject *prev_d = NULL, *complete = NULL, *frames = NULL; /* the last context's, reused */
    PyObject *prev_nr = NULL, *name = NULL;                     /* the last syscall's */
    Py_ssize_t nwords = 0, seen = 0, lost = 0;
    if (!out || !incomplete)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(raw, i);
        PyObject *key = PyTuple_Pack(2, PyTuple_GET_ITEM(r, H_KEY1), PyTuple_GET_ITEM(r, H_KEY2));
        if (!key)
            goto error;
        PyObject *got = PyDict_GetItemWithError(contexts, key); /* borrowed */
        Py_DECREF(key);
        PyObject *d;
        if (got) {
            if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2) {
                PyErr_SetString(PyExc_TypeError, "hit_samples: contexts values must be (context, decoded)");
                goto error;
            }
            d = PyTuple_GET_ITEM(got, 1);
        } else {
            if (PyErr_Occurred())
                goto error;
            d = lost_decoded;
            lost++;
        }
        if (d != prev_d) {
            Py_CLEAR(complete);
            Py_CLEAR(frames);
            Py_XSETREF(prev_d, Py_NewRef(d));
            complete = PyObject_GetAttr(d, s_complete);
            if (!complete)
                goto error;
            frames = PyObject_CallMethodNoArgs(d, s_json_frames);
            if (!frames)
                goto error;
        }
        PyObject *nr = PyTuple_GET_ITEM(r, H_NR);
        long nrv = PyLong_AsLong(nr);
        if (nrv == -1 && PyErr_Occurred())
            goto error;
        PyObject *words = NULL;
        if (nrv >= 0) {
            if (!prev_nr || PyObject_RichCompareBool(prev_nr, nr, Py_EQ) != 1) {
                PyObject *inf = PyDict_GetItemWithError(info, nr); /* borrowed */
                PyObject *made = NULL;
                if (!inf) {
                    if (PyErr_Occurred())
                        goto error;
                    inf = made = PyObject_CallOneArg(info_fn, nr);
                    if (!inf)
                        goto error;
                }
                Py_ssize_t w = -1;
                if (PyTuple_Check(inf) && PyTuple_GET_SIZE(inf) == 2)
                    w = PyLong_AsSsize_t(PyTuple_GET_ITEM(inf, 1));
                if (w < 0) {
                    Py_XDECREF(made);
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_TypeError, "hit_samples: syscall info must be (name, words)");
                    goto error;
                }
                Py_XSETREF(name, Py_NewRef(PyTuple_GET_ITEM(inf, 0)));
                Py_XDECREF(made);
                nwords = w;
                Py_XSETREF(prev_nr, Py_NewRef(nr));
            }
            words = PyTuple_GetSlice(r, H_ARGS, H_ARGS + nwords);
            if (!words)
                goto error;
        }
        PyObject *t = PyNumber_Add(PyTuple_GET_ITEM(r, H_TIME), offset);
        if (!t) {
            Py_XDECREF(words);
            goto error;
        }
        PyObject *s = sample_type->tp_alloc(sample_type, 0);
        if (!s) {
            Py_DECREF(t);
            Py_XDECREF(words);
            goto error;
        }
        *(PyObject **)((char *)s + offsets[F_TIME]) = t; /* the new references move in */
        set_slot(s, F_PID, PyTuple_GET_ITEM(r, H_TGID));
        set_slot(s, F_TID, PyTuple_GET_ITEM(r, H_TID));
        set_slot(s, F_EVENT, nrv < 0 ? s_cpu : s_syscall);
        set_slot(s, F_SYSCALL, nrv < 0 ? Py_None : name);
        set_slot(s, F_COMPLETE, complete);
        set_slot(s, F_FRAMES, frames);
        set_slot(s, F_ARGS, Py_None);
        *(PyObject **)((char *)s + offsets[F_RAW]) = words ? words : Py_NewRef(Py_None);
        set_slot(s, F_RETURNED, Py_None);
        set_slot(s, F_RET, Py_None);
        PyList_SET_ITEM(out, i, s);
        int c = PyObject_IsTrue(complete);
        if (c < 0)
            goto error;
        if (c)
            seen++;
        else if (PyList_Append(incomplete, d))
            goto error;
    }
    Py_XDECREF(prev_d);
    Py_XDECREF(complete);
    Py_XDECREF(frames);
    Py_XDECREF(prev_nr);
    Py_XDECREF(name);
    PyObject *res = Py_BuildValue("(NnnN)", out, seen, lost, incomplete);
    return res;
error:
    Py_XDECREF(out); /* unfilled items are NULL: list_dealloc skips them */
    Py_XDECREF(incomplete);
    Py_XDECREF(prev_d);
    Py_XDECREF(complete);
    Py_XDECREF(frames);
    Py_XDECREF(prev_nr);
    Py_XDECREF(name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"prepare", (PyCFunction)(void (*)(void))prepare, METH_FASTCALL, "prepare(TraceSample, field names)"},
    {"hit_samples", (PyCFunction)(void (*)(void))hit_samples, METH_FASTCALL,
     "hit_samples(raw, contexts, info, info_fn, offset, lost_decoded): a batch of hit headers as TraceSamples"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "chits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_chits(void)
{
    if (!(s_complete = PyUnicode_InternFromString("complete")) ||
        !(s_json_frames = PyUnicode_InternFromString("json_frames")) ||
        !(s_cpu = PyUnicode_InternFromString("cpu")) || !(s_syscall = PyUnicode_InternFromString("syscall")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    /* the HitHeader indices this file reads, checked against sampler.py's at import (mode.py) */
    if (!m)
        return NULL;
    PyObject *header = Py_BuildValue("(iiiiiiii)", H_TIME, H_TGID, H_TID, H_NR, H_KEY1, H_KEY2, H_ARGS, H_LEN);
    int err = !header || PyModule_AddObjectRef(m, "HEADER", header) < 0;
    Py_XDECREF(header);
    if (err) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
