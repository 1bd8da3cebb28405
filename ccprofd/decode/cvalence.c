/* The compiled half of ccprofd/decode/valence.py: ValenceDecoder._acyclic's loop (Algorithm 2's
 * steps from a node to the root, the whole decode of a context with no segment and no recID).
 *
 * Why C: a new context's ~20 steps were about a third of the ~75 us it cost `ccprofd trace`
 * (issue 16's target for distinct contexts is 50 us).  This walks the same tables (node_table,
 * callee, caller, edge: lists built by the Python decoder) with the acycID in 64 bits.  Anything
 * it cannot do exactly -- an acycID wider than 64 bits, a table entry of an unexpected shape, any
 * code the Python loop refuses -- returns None having changed nothing, and the Python loop (the
 * reference) decodes the state again and raises its own DecodeError with its message.
 * tests/test_encode_paper_examples.py decodes every acycID both ways.
 *
 * acyclic(m, acyc, out, table, callee, caller, edge, root) -> out (edges appended innermost first,
 * then reversed: outermost first) or None.
 * Built by scripts/build_ext.sh (run by scripts/setup.sh); valence.py falls back without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* a non-negative Py_ssize_t from an exact int; -1 when it is not one */
static inline Py_ssize_t index_of(PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x < 0) {
        PyErr_Clear();
        return -1;
    }
    return x;
}

/* a uint64 from an exact non-negative int; 0 with *bad set when it is not one */
static inline uint64_t u64_of(PyObject *v, int *bad)
{
    if (!PyLong_CheckExact(v)) {
        *bad = 1;
        return 0;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        *bad = 1;
        return 0;
    }
    return (uint64_t)x;
}

static inline uint64_t shr(uint64_t v, Py_ssize_t n) { return n >= 64 ? 0 : v >> n; }

static PyObject *acyclic(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8 || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3]) || !PyList_CheckExact(args[4]) ||
        !PyList_CheckExact(args[5]) || !PyList_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError, "acyclic(m, acyc, out, table, callee, caller, edge, root)");
        return NULL;
    }
    PyObject *out = args[2], *table = args[3], *callee = args[4], *caller = args[5], *edge = args[6];
    int bad = 0;
    Py_ssize_t m = index_of(args[0]), root = index_of(args[7]);
    uint64_t acyc = u64_of(args[1], &bad);
    if (m < 0 || root < 0 || bad)
        Py_RETURN_NONE;
    Py_ssize_t ntable = PyList_GET_SIZE(table), nedges = PyList_GET_SIZE(edge);
    if (PyList_GET_SIZE(callee) != nedges || PyList_GET_SIZE(caller) != nedges)
        Py_RETURN_NONE;
    Py_ssize_t start = PyList_GET_SIZE(out), steps = 0;
    while (m != root) {
        if (m >= ntable || ++steps > ntable) /* a cycle would be a broken table: Python says so */
            goto refuse;
        PyObject *comp = PyList_GET_ITEM(table, m); /* (level, lvLow, lvMask, groups) */
        if (!PyTuple_CheckExact(comp) || PyTuple_GET_SIZE(comp) != 4 || !PyList_CheckExact(PyTuple_GET_ITEM(comp, 3)))
            goto refuse;
        Py_ssize_t lv_low = index_of(PyTuple_GET_ITEM(comp, 1));
        uint64_t lv_mask = u64_of(PyTuple_GET_ITEM(comp, 2), &bad);
        PyObject *groups = PyTuple_GET_ITEM(comp, 3);
        if (lv_low < 0 || bad)
            goto refuse;
        uint64_t lv_code = shr(acyc, lv_low) & lv_mask;
        if (lv_code >= (uint64_t)PyList_GET_SIZE(groups))
            goto refuse;
        PyObject *g = PyList_GET_ITEM(groups, (Py_ssize_t)lv_code); /* (parent level, edge mask, edges) */
        if (!PyTuple_CheckExact(g) || PyTuple_GET_SIZE(g) != 3 || !PyList_CheckExact(PyTuple_GET_ITEM(g, 2)))
            goto refuse;
        Py_ssize_t pl = index_of(PyTuple_GET_ITEM(g, 0));
        uint64_t e_mask = u64_of(PyTuple_GET_ITEM(g, 1), &bad);
        PyObject *edges = PyTuple_GET_ITEM(g, 2);
        if (pl < 0 || bad)
            goto refuse;
        uint64_t e_code = shr(acyc, pl) & e_mask;
        if (e_code >= (uint64_t)PyList_GET_SIZE(edges))
            goto refuse;
        Py_ssize_t e = index_of(PyList_GET_ITEM(edges, (Py_ssize_t)e_code));
        if (e < 0 || e >= nedges || index_of(PyList_GET_ITEM(callee, e)) != m)
            goto refuse;
        if (PyList_Append(out, PyList_GET_ITEM(edge, e)))
            goto error;
        m = index_of(PyList_GET_ITEM(caller, e));
        if (m < 0)
            goto refuse;
    }
    if (PyList_Reverse(out))
        goto error;
    return Py_NewRef(out);
refuse:
    if (PyErr_Occurred())
        goto error;
    if (PyList_SetSlice(out, start, PyList_GET_SIZE(out), NULL)) /* as it was */
        return NULL;
    Py_RETURN_NONE;
error:
    return NULL;
}

static PyMethodDef methods[] = {
    {"acyclic", (PyCFunction)(void (*)(void))acyclic, METH_FASTCALL,
     "acyclic(m, acyc, out, table, callee, caller, edge, root): Valence's acyclic steps, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cvalence", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_cvalence(void) { return PyModule_Create(&module); }
