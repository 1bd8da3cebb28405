/* The compiled half of ccprofd/export/jsonl.py's JsonlWriter: a batch of TraceSamples -> JSONL text.
 *
 * Why C: at 200,000 samples a second a repeated context has ~5 us for everything; formatting its
 * line in Python (attribute reads, an f-string, the argument words' str()) took ~3.5 us of them.
 * This loop does only the common line -- the context's serialised tail already cached by the
 * writer (JsonlWriter._tails, by id(frames); an incomplete one's holds its reason), no path
 * argument, no return value, exact ints --
 * and hands every other sample to the writer's Python code (``slow``), so the output is the same
 * bytes as the pure-Python path by construction (tests/test_export_writers.py compares them).
 *
 * format_samples(samples, tails, slow, lines[, tail_of]): appends the batch's text to ``lines`` (a
 * list of str, joined and written by JsonlWriter.flush()); ``slow(sample)`` returns one sample's
 * line; ``tail_of(sample)`` (JsonlWriter._tail) serialises and caches the tail of a context not in
 * ``tails`` yet, so a new context's common line is formatted here too (a distinct-context flood).
 * Built by scripts/build_ext.sh (run by scripts/setup.sh); jsonl.py falls back without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} buf_t;

static PyObject *s_frames, *s_event, *s_syscall, *s_complete, *s_reason, *s_args, *s_returned,
    *s_raw_args, *s_time_ns, *s_pid, *s_tid;

/* JsonlWriter._tails values: (frames, event, syscall, complete, reason, tail) */
#define TAIL_FIELDS 6

static int buf_reserve(buf_t *b, Py_ssize_t extra)
{
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_put(buf_t *b, const char *s, Py_ssize_t n)
{
    if (buf_reserve(b, n))
        return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

/* Decimal text of v (as Python's str() of a non-negative int). */
static int buf_u64(buf_t *b, unsigned long long v)
{
    char tmp[24];
    int i = 24;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return buf_put(b, tmp + i, 24 - i);
}

/* str(v) of an exact int into the buffer; 1: not representable here (the caller takes the slow path). */
static int buf_int(buf_t *b, PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return 1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        return buf_u64(b, u);
    }
    if (overflow < 0)
        return 1;
    if (x < 0) {
        if (buf_put(b, "-", 1))
            return -1;
        return buf_u64(b, (unsigned long long)0 - (unsigned long long)x);
    }
    return buf_u64(b, (unsigned long long)x);
}

/* The buffer's text as one str appended to lines (everything in it is ASCII). */
static int buf_flush(buf_t *b, PyObject *lines)
{
    if (!b->len)
        return 0;
    PyObject *s = PyUnicode_New(b->len, 127);
    if (!s)
        return -1;
    memcpy(PyUnicode_1BYTE_DATA(s), b->p, (size_t)b->len);
    b->len = 0;
    int r = PyList_Append(lines, s);
    Py_DECREF(s);
    return r;
}

/* 0: the sample's line is in the buffer; 1: not the common line (nothing added); 2: no tail cached
 * for this sample's context (nothing added: ``tail_of`` may make it, then this is tried again);
 * -1: error. */
static int fast_line(buf_t *b, PyObject *s, PyObject *tails)
{
    int rc = 1;
    PyObject *frames = NULL, *key = NULL, *v = NULL;
    Py_ssize_t mark = b->len;

    frames = PyObject_GetAttr(s, s_frames);
    if (!frames)
        return -1;
    key = PyLong_FromVoidPtr(frames); /* id(frames) */
    if (!key)
        goto error;
    PyObject *got = PyDict_GetItemWithError(tails, key); /* borrowed */
    if (!got) {
        if (PyErr_Occurred())
            goto error;
        rc = 2;
        goto out;
    }
    if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != TAIL_FIELDS || PyTuple_GET_ITEM(got, 0) != frames) {
        rc = 2;
        goto out;
    }
    /* the cached tail is this context's only under the same event, syscall, completeness and reason */
    static PyObject **const same[4] = {&s_event, &s_syscall, &s_complete, &s_reason};
    for (int i = 0; i < 4; i++) {
        v = PyObject_GetAttr(s, *same[i]);
        if (!v)
            goto error;
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(got, i + 1), v, Py_EQ);
        Py_CLEAR(v);
        if (eq < 0)
            goto error;
        if (!eq) {
            rc = 2;
            goto out;
        }
    }
    PyObject *tail = PyTuple_GET_ITEM(got, TAIL_FIELDS - 1);
    if (!PyUnicode_CheckExact(tail) || !PyUnicode_IS_ASCII(tail))
        goto out;
    v = PyObject_GetAttr(s, s_args); /* a path argument: the long way */
    if (!v)
        goto error;
    int has_args = PyObject_IsTrue(v);
    Py_CLEAR(v);
    if (has_args < 0)
        goto error;
    if (has_args)
        goto out;
    v = PyObject_GetAttr(s, s_returned);
    if (!v)
        goto error;
    int returned = v != Py_None;
    Py_CLEAR(v);
    if (returned)
        goto out;

    static const char *const names[3] = {"{\"time_ns\":", ",\"pid\":", ",\"tid\":"};
    PyObject **const fields[3] = {&s_time_ns, &s_pid, &s_tid};
    for (int i = 0; i < 3; i++) {
        if (buf_put(b, names[i], (Py_ssize_t)strlen(names[i])))
            goto error;
        v = PyObject_GetAttr(s, *fields[i]);
        if (!v)
            goto error;
        int r = buf_int(b, v);
        Py_CLEAR(v);
        if (r < 0)
            goto error;
        if (r > 0)
            goto out;
    }
    if (buf_put(b, ",", 1) || buf_put(b, (const char *)PyUnicode_1BYTE_DATA(tail), PyUnicode_GET_LENGTH(tail)))
        goto error;
    v = PyObject_GetAttr(s, s_raw_args);
    if (!v)
        goto error;
    if (v == Py_None) {
        if (buf_put(b, "}\n", 2))
            goto error;
    } else {
        if (!PyTuple_CheckExact(v))
            goto out;
        if (buf_put(b, ",\"raw_args\":[", 13))
            goto error;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); i++) {
            if (i && buf_put(b, ",", 1))
                goto error;
            int r = buf_int(b, PyTuple_GET_ITEM(v, i));
            if (r < 0)
                goto error;
            if (r > 0)
                goto out;
        }
        if (buf_put(b, "]}\n", 3))
            goto error;
    }
    rc = 0;
    goto done;
error:
    rc = -1;
out:
    if (rc != 0)
        b->len = mark;
done:
    Py_XDECREF(v);
    Py_XDECREF(key);
    Py_XDECREF(frames);
    return rc;
}

static PyObject *format_samples(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "format_samples(samples, tails, slow, lines[, tail_of])");
        return NULL;
    }
    PyObject *samples = args[0], *tails = args[1], *slow = args[2], *lines = args[3];
    PyObject *tail_of = nargs == 5 && args[4] != Py_None ? args[4] : NULL;
    if (!PyDict_Check(tails) || !PyList_Check(lines)) {
        PyErr_SetString(PyExc_TypeError, "format_samples: tails must be a dict and lines a list");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(samples, "format_samples: samples must be a sequence");
    if (!seq)
        return NULL;
    buf_t b = {NULL, 0, 0};
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PySequence_Fast_GET_ITEM(seq, i);
        int r = fast_line(&b, s, tails);
        if (r == 2 && tail_of) { /* a context not formatted yet: its tail made (and cached) once */
            PyObject *t = PyObject_CallOneArg(tail_of, s);
            if (!t)
                goto error;
            Py_DECREF(t);
            r = fast_line(&b, s, tails);
        }
        if (r < 0)
            goto error;
        if (r == 0)
            continue;
        PyObject *line = PyObject_CallOneArg(slow, s);
        if (!line)
            goto error;
        if (!PyUnicode_Check(line)) {
            Py_DECREF(line);
            PyErr_SetString(PyExc_TypeError, "format_samples: slow() must return str");
            goto error;
        }
        int err;
        if (PyUnicode_IS_ASCII(line))
            err = buf_put(&b, (const char *)PyUnicode_1BYTE_DATA(line), PyUnicode_GET_LENGTH(line));
        else /* kept as it is, in order */
            err = buf_flush(&b, lines) || PyList_Append(lines, line);
        Py_DECREF(line);
        if (err)
            goto error;
    }
    if (buf_flush(&b, lines))
        goto error;
    PyMem_Free(b.p);
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    PyMem_Free(b.p);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"format_samples", (PyCFunction)(void (*)(void))format_samples, METH_FASTCALL,
     "format_samples(samples, tails, slow, lines[, tail_of]): append the JSONL text of samples to lines."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cjsonl", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_cjsonl(void)
{
    struct {
        PyObject **dst;
        const char *name;
    } names[] = {{&s_frames, "frames"}, {&s_event, "event"},       {&s_syscall, "syscall"},
                 {&s_complete, "complete"}, {&s_reason, "reason"},   {&s_args, "args"},
                 {&s_returned, "returned"},
                 {&s_raw_args, "raw_args"}, {&s_time_ns, "time_ns"}, {&s_pid, "pid"},
                 {&s_tid, "tid"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].dst = PyUnicode_InternFromString(names[i].name);
        if (!*names[i].dst)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    /* format_samples takes tail_of: a helper built from an older cjsonl.c (a stale build) does
     * not, and jsonl.py then calls it with four arguments */
    if (m && PyModule_AddIntConstant(m, "TAKES_TAIL_OF", 1) < 0)
        Py_CLEAR(m);
    /* the tails' layout: jsonl.py does not use a helper built for another one */
    if (m && PyModule_AddIntConstant(m, "TAIL_FIELDS", TAIL_FIELDS) < 0)
        Py_CLEAR(m);
    return m;
}
