/* The compiled half of unwind mode's flood path: a poll's hit records -> TraceSamples.
 *
 * Why C: a repeated context (a "hit": the header-only record BPF sends for a context it has seen)
 * had ~5 us of Python for everything at the 200,000 samples/s target, and building its
 * TraceSample (a dataclass __init__ of 12 fields, ~0.8 us) plus the loop around it took half.
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
#include <stdint.h>
#include <string.h>

enum { F_TIME, F_PID, F_TID, F_EVENT, F_SYSCALL, F_COMPLETE, F_FRAMES, F_ARGS, F_RAW, F_RETURNED, F_RET, F_REASON,
       NFIELDS };
/* HitHeader indices (sampler.py: HIT_*) */
enum { H_TIME = 0, H_TGID = 2, H_TID = 3, H_NR = 4, H_KEY1 = 9, H_KEY2 = 10, H_ARGS = 13, H_LEN = 19 };

static PyTypeObject *sample_type;
static Py_ssize_t offsets[NFIELDS];
static PyObject *s_complete, *s_json_frames, *s_cpu, *s_syscall, *s_reason;

static PyObject *prepare(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != NFIELDS) {
        PyErr_SetString(PyExc_TypeError, "prepare(TraceSample, its 12 field names in order)");
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
    PyObject *prev_d = NULL, *complete = NULL, *frames = NULL, *reason = NULL; /* the last context's, reused */
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
            Py_CLEAR(reason);
            Py_XSETREF(prev_d, Py_NewRef(d));
            complete = PyObject_GetAttr(d, s_complete);
            if (!complete)
                goto error;
            int c = PyObject_IsTrue(complete); /* the reason of an incomplete context only */
            if (c < 0)
                goto error;
            reason = c ? Py_NewRef(Py_None) : PyObject_GetAttr(d, s_reason);
            if (!reason)
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
        set_slot(s, F_REASON, reason);
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
    Py_XDECREF(reason);
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
    Py_XDECREF(reason);
    Py_XDECREF(prev_nr);
    Py_XDECREF(name);
    return NULL;
}


/* ------------------------------------------------------------------ new-context records
 * decode_record(raw, ev_hit, arg_len_max, (acyc_words, max_segs, rec_words, max_unan), reasons)
 *   -> UnwoundSample | None: UnwoundSample.decode(raw, layout) for a whole record (not a hit), the
 *   same objects field for field; None for anything else (a hit, a record shorter than its layout,
 *   a reason not in ``reasons``, a recID over more than one word): the Python decode does those
 *   (and raises struct.error for a short record, which the sampler counts as malformed).
 * prepare_records(UnwoundSample, EncodedRecord, EncodedSegment, UnanalysedFrame, names of each). */
enum { R_SAMPLE, R_RECORD, R_SEGMENT, R_UNAN, NCLASSES };
static const int nfields_of[NCLASSES] = {13, 9, 6, 4};
static PyTypeObject *rec_types[NCLASSES];
static Py_ssize_t rec_offsets[NCLASSES][13];
#define EXACT (1ULL << 63)
#define HDR 112 /* struct uw_sample up to its path argument (sampler.py: _SAMPLE_HDR) */

static PyObject *prepare_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 * NCLASSES) {
        PyErr_SetString(PyExc_TypeError, "prepare_records(4 classes, then 4 tuples of field names)");
        return NULL;
    }
    for (int c = 0; c < NCLASSES; c++) {
        PyObject *names = args[NCLASSES + c];
        if (!PyType_Check(args[c]) || !PyTuple_Check(names) || PyTuple_GET_SIZE(names) != nfields_of[c]) {
            PyErr_SetString(PyExc_TypeError, "prepare_records: a class or its field names do not fit");
            return NULL;
        }
        for (int i = 0; i < nfields_of[c]; i++) {
            PyObject *d = PyObject_GetAttr(args[c], PyTuple_GET_ITEM(names, i));
            if (!d)
                return NULL;
            int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
            if (ok)
                rec_offsets[c][i] = ((PyMemberDescrObject *)d)->d_member->offset;
            Py_DECREF(d);
            if (!ok) {
                PyErr_SetString(PyExc_TypeError, "prepare_records: a field is not an object slot");
                return NULL;
            }
        }
    }
    for (int c = 0; c < NCLASSES; c++)
        Py_XSETREF(rec_types[c], (PyTypeObject *)Py_NewRef(args[c]));
    Py_RETURN_NONE;
}

/* An instance of class c with its fields set from vals (references stolen; all must be non-NULL). */
static PyObject *make(int c, PyObject **vals)
{
    PyObject *o = NULL;
    for (int i = 0; i < nfields_of[c]; i++)
        if (!vals[i])
            goto fail;
    o = rec_types[c]->tp_alloc(rec_types[c], 0);
    if (!o)
        goto fail;
    for (int i = 0; i < nfields_of[c]; i++)
        *(PyObject **)((char *)o + rec_offsets[c][i]) = vals[i];
    return o;
fail:
    for (int i = 0; i < nfields_of[c]; i++)
        Py_XDECREF(vals[i]);
    return NULL;
}

static inline uint32_t u32at(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t u64at(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static PyObject *words_tuple(const unsigned char *p, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    if (!t)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(u64at(p + 8 * i));
        if (!v) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *decode_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) != 4 ||
        !PyDict_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "decode_record(raw, ev_hit, arg_len, layout, reasons)");
        return NULL;
    }
    if (!rec_types[0]) {
        PyErr_SetString(PyExc_RuntimeError, "decode_record: prepare_records() first");
        return NULL;
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    long ev_hit = PyLong_AsLong(args[1]);
    Py_ssize_t arg_max = PyLong_AsSsize_t(args[2]);
    Py_ssize_t w = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], 0)), max_segs = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], 1)),
               rec_words = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], 2)),
               max_unan = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], 3));
    if (PyErr_Occurred())
        return NULL;
    if (len < HDR || w < 1 || max_segs < 0 || rec_words < 0 || max_unan < 0 || arg_max < 0)
        Py_RETURN_NONE;
    uint32_t kind = u32at(b + 8), n = u32at(b + 24), reason = u32at(b + 28), arg_len = u32at(b + 56);
    int32_t nr;
    memcpy(&nr, b + 20, 4);
    if ((long)kind == ev_hit)
        Py_RETURN_NONE;
    Py_ssize_t hdr_words = 4 + w, seg_words = w + 4;
    Py_ssize_t layout_size = 8 * (hdr_words + max_segs * seg_words + rec_words + 2 * max_unan);
    Py_ssize_t off = HDR + arg_max, pcs_off = off + layout_size;
    if (pcs_off + 8 * (Py_ssize_t)n > len)
        Py_RETURN_NONE; /* short: Python raises struct.error */
    const unsigned char *r = b + off;
    uint32_t rnode = u32at(r), rflags = u32at(r + 4), rec_len = u32at(r + 8), nsegs = u32at(r + 12);
    uint64_t inner = u64at(r + 16);
    uint32_t nunan = u32at(r + 24), nframes = u32at(r + 28);
    Py_ssize_t rec_n = ((Py_ssize_t)rec_len + 63) / 64;
    if (rec_n > rec_words)
        rec_n = rec_words;
    if (rec_n > 1)
        Py_RETURN_NONE; /* a recID over several words: Python's big-int assembly */

    PyObject *why;
    if (reason == 0) {
        why = Py_NewRef(Py_None);
    } else {
        PyObject *k = PyLong_FromUnsignedLong(reason);
        if (!k)
            return NULL;
        why = PyDict_GetItemWithError(args[4], k);
        Py_DECREF(k);
        if (!why) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE; /* Python names it reason_N */
        }
        Py_INCREF(why);
    }
    PyObject *arg;
    if (arg_len > 0 && arg_len <= (uint64_t)arg_max) {
        Py_ssize_t avail = len - HDR < (Py_ssize_t)arg_len ? len - HDR : (Py_ssize_t)arg_len;
        const unsigned char *z = memchr(b + HDR, 0, (size_t)avail);
        arg = PyUnicode_DecodeUTF8((const char *)b + HDR, z ? z - (b + HDR) : avail, "surrogateescape");
    } else {
        arg = Py_NewRef(Py_None);
    }
    /* the encoded context (RecordLayout.parse) */
    PyObject *segs = PyTuple_New(nsegs < (uint64_t)max_segs ? nsegs : max_segs);
    Py_ssize_t base = off + 8 * hdr_words, seg_bytes = 8 * seg_words;
    for (Py_ssize_t i = 0; segs && i < PyTuple_GET_SIZE(segs); i++) {
        const unsigned char *p = b + base + seg_bytes * i, *q = p + 8 * w;
        int64_t site;
        memcpy(&site, q + 16, 8);
        PyObject *v[6] = {words_tuple(p, w), PyLong_FromUnsignedLong(u32at(q)), PyLong_FromUnsignedLong(u32at(q + 4)),
                          PyLong_FromUnsignedLong(u32at(q + 8)), PyLong_FromLongLong(site),
                          PyLong_FromUnsignedLongLong(u64at(q + 24))};
        PyObject *s = make(R_SEGMENT, v);
        if (!s) {
            Py_CLEAR(segs);
            break;
        }
        PyTuple_SET_ITEM(segs, i, s);
    }
    Py_ssize_t rbase = base + seg_bytes * max_segs, ubase = rbase + 8 * rec_words;
    uint64_t rec = 0;
    if (rec_n == 1) {
        rec = u64at(b + rbase);
        if (rec_len < 64)
            rec &= (1ULL << rec_len) - 1;
    }
    Py_ssize_t nu = nunan ? (nunan < (uint64_t)max_unan ? nunan : max_unan) : 0;
    PyObject *unan = PyTuple_New(nu);
    for (Py_ssize_t i = 0; unan && i < nu; i++) {
        uint64_t a = u64at(b + ubase + 16 * i), v = u64at(b + ubase + 16 * i + 8);
        PyObject *vals[4] = {PyLong_FromUnsignedLongLong(a & 0xFFFFFFFFULL), PyLong_FromUnsignedLongLong((a >> 32) & 0xFFFF),
                             PyLong_FromUnsignedLongLong(v & ~EXACT), PyBool_FromLong((v & EXACT) != 0)};
        PyObject *u = make(R_UNAN, vals);
        if (!u) {
            Py_CLEAR(unan);
            break;
        }
        PyTuple_SET_ITEM(unan, i, u);
    }
    PyObject *rv[9] = {PyLong_FromUnsignedLong(rnode), PyLong_FromUnsignedLong(rflags), PyLong_FromUnsignedLongLong(inner),
                       PyLong_FromUnsignedLong(nframes), words_tuple(r + 32, w), PyLong_FromUnsignedLongLong(rec),
                       PyLong_FromUnsignedLong(rec_len), segs, unan};
    PyObject *enc = make(R_RECORD, rv);
    /* the pcs, innermost first, their exact bit apart */
    PyObject *pcs = PyTuple_New(n), *exact = PyTuple_New(n);
    for (Py_ssize_t i = 0; pcs && exact && i < (Py_ssize_t)n; i++) {
        uint64_t v = u64at(b + pcs_off + 8 * i);
        PyObject *pc = PyLong_FromUnsignedLongLong(v & ~EXACT);
        if (!pc) {
            Py_CLEAR(pcs);
            break;
        }
        PyTuple_SET_ITEM(pcs, i, pc);
        PyTuple_SET_ITEM(exact, i, PyBool_FromLong((v & EXACT) != 0));
    }
    PyObject *regs = nr < 0 ? Py_NewRef(Py_None) : words_tuple(b + 64, 6);
    PyObject *key = Py_BuildValue("(KK)", (unsigned long long)u64at(b + 40), (unsigned long long)u64at(b + 48));
    PyObject *sv[13] = {PyLong_FromUnsignedLongLong(u64at(b)), PyLong_FromUnsignedLong(u32at(b + 12)),
                        PyLong_FromUnsignedLong(u32at(b + 16)), nr < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(nr),
                        pcs, why, PyLong_FromUnsignedLong(u32at(b + 32)), PyLong_FromUnsignedLong(u32at(b + 36)),
                        key, exact, enc, arg, regs};
    return make(R_SAMPLE, sv);
}

static PyMethodDef methods[] = {
    {"prepare", (PyCFunction)(void (*)(void))prepare, METH_FASTCALL, "prepare(TraceSample, field names)"},
    {"prepare_records", (PyCFunction)(void (*)(void))prepare_records, METH_FASTCALL, "prepare_records(classes, names)"},
    {"decode_record", (PyCFunction)(void (*)(void))decode_record, METH_FASTCALL,
     "decode_record(raw, ev_hit, arg_len, layout, reasons): UnwoundSample.decode of a whole record, or None"},
    {"hit_samples", (PyCFunction)(void (*)(void))hit_samples, METH_FASTCALL,
     "hit_samples(raw, contexts, info, info_fn, offset, lost_decoded): a batch of hit headers as TraceSamples"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "chits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_chits(void)
{
    if (!(s_complete = PyUnicode_InternFromString("complete")) ||
        !(s_json_frames = PyUnicode_InternFromString("json_frames")) ||
        !(s_cpu = PyUnicode_InternFromString("cpu")) || !(s_syscall = PyUnicode_InternFromString("syscall")) ||
        !(s_reason = PyUnicode_InternFromString("reason")))
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
