/* The compiled half of ccprofd/callgraph/disasm.py: sweep()'s loop over capstone's cs_insn records.
 *
 * Why C: after capstone itself, that loop (pick the calls, jumps, lea, mov and push records, read
 * their operand text, build the branches and code references) was about 40% of a cold `analyze`
 * (issue 18: python3.11's 690k instructions, node's 7M).  It makes the same decisions as
 * disasm.sweep, the reference, step for step, on the same record bytes: the instruction id's class
 * from a table built by disasm._looked_at_ids, the mnemonic's first letter, the raw bytes of rel8 and
 * rel32 jumps, and the operand text parsed as disasm's regular expressions parse it (_IMM, _RIP,
 * _TRAILING_IMM).  Anything it cannot decide exactly as Python would -- a number over 64 bits, a
 * decimal number with a leading zero (int(x, 0) refuses it), an unterminated text -- returns None
 * having built nothing, and the Python loop sweeps that range instead.
 * tests/test_callgraph_csweep.py compares both on every function of several binaries.
 *
 * scan(buf, n, code, base, local_jumps, classes, jcc, layout, branch) -> (branches, refs) or None
 *   buf: n cs_insn records (layout: record size, mnemonic, op_str, bytes offsets, CALL and JMP ids);
 *   classes[id]: 1 branch, 2 mov/movabs, 4 lea/push, 0 not looked at; jcc[id]: 1 for a jcc id;
 *   branch: the Branch class (a NamedTuple: its tuple is allocated and filled here; any other class
 *   is called with the seven fields in order).
 * Built by scripts/build_ext.sh; disasm.py falls back without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { C_BRANCH = 1, C_MOVE = 2, C_OTHER = 4 };

typedef struct {
    Py_ssize_t insn, mnem, ops, bytes, mnem_len, ops_len;
    unsigned long call_id, jmp_id;
} layout_t;

/* 1: parsed; 0: not a number of the form; -1: a form Python parses differently (fall back) */
static int parse_number(const char *s, size_t len, uint64_t *out)
{
    if (len >= 3 && s[0] == '0' && s[1] == 'x') {
        uint64_t v = 0;
        if (len - 2 > 16)
            return -1;
        for (size_t i = 2; i < len; i++) {
            char c = s[i];
            if (c >= '0' && c <= '9')
                v = v << 4 | (uint64_t)(c - '0');
            else if (c >= 'a' && c <= 'f')
                v = v << 4 | (uint64_t)(c - 'a' + 10);
            else
                return 0;
        }
        *out = v;
        return 1;
    }
    if (len == 0)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    if (len > 1 && s[0] == '0')
        return -1; /* int("012", 0) raises */
    if (len > 19)
        return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++)
        v = v * 10 + (uint64_t)(s[i] - '0');
    *out = v;
    return 1;
}

/* _RIP.search: the first "[rip]" or "[rip + N]" / "[rip - N]"; 1 found, 0 not, -1 fall back */
static int rip_disp(const char *s, size_t len, int64_t *disp)
{
    for (size_t p = 0; p + 4 <= len; p++) {
        if (memcmp(s + p, "[rip", 4) != 0)
            continue;
        size_t q = p + 4;
        if (q + 3 <= len && s[q] == ' ' && (s[q + 1] == '+' || s[q + 1] == '-') && s[q + 2] == ' ') {
            size_t a = q + 3, b = a;
            while (b < len && s[b] != ']')
                b++;
            if (b < len) {
                uint64_t v;
                int r = parse_number(s + a, b - a, &v);
                if (r < 0)
                    return -1;
                if (r == 1) {
                    if (v > (uint64_t)INT64_MAX)
                        return -1;
                    *disp = s[q + 1] == '-' ? -(int64_t)v : (int64_t)v;
                    return 1;
                }
            }
        }
        if (q < len && s[q] == ']') {
            *disp = 0;
            return 1;
        }
    }
    return 0;
}

static int append_int(PyObject *list, uint64_t v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (!o)
        return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

static int text_len(const char *s, Py_ssize_t cap, size_t *len)
{
    const char *z = memchr(s, 0, (size_t)cap);
    if (!z)
        return -1;
    *len = (size_t)(z - s);
    return 0;
}

static inline int mov_rm(unsigned char b) { return b >= 0x88 && b <= 0x8B; }

static PyObject *scan(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf, code, classes, jcc;
    Py_ssize_t n;
    unsigned long long base;
    int local_jumps;
    PyObject *lay, *branch_type;
    if (!PyArg_ParseTuple(args, "y*ny*Kpy*y*OO", &buf, &n, &code, &base, &local_jumps, &classes, &jcc, &lay,
                          &branch_type))
        return NULL;
    PyObject *branches = NULL, *refs = NULL, *result = NULL;
    layout_t L;
    if (!PyArg_ParseTuple(lay, "nnnnnnkk", &L.insn, &L.mnem, &L.ops, &L.bytes, &L.mnem_len, &L.ops_len,
                          &L.call_id, &L.jmp_id))
        goto done;
    if (n < 0 || L.insn <= 0 || n > buf.len / L.insn || L.insn < 24 || L.mnem + L.mnem_len > L.insn ||
        L.ops + L.ops_len > L.insn || L.bytes + 24 > L.insn) {
        PyErr_SetString(PyExc_ValueError, "csweep.scan: bad record layout");
        goto done;
    }
    branches = PyList_New(0);
    refs = PyList_New(0);
    if (!branches || !refs)
        goto done;
    /* a plain tuple subclass (a NamedTuple: no instance dict, no extra fields) is allocated directly */
    int as_tuple = PyType_Check(branch_type) &&
                   PyType_IsSubtype((PyTypeObject *)branch_type, &PyTuple_Type) &&
                   ((PyTypeObject *)branch_type)->tp_basicsize == PyTuple_Type.tp_basicsize &&
                   ((PyTypeObject *)branch_type)->tp_dictoffset == 0;
    const unsigned char *B = buf.buf, *C = code.buf, *cls = classes.buf, *jc = jcc.buf;
    uint64_t end = base + (uint64_t)code.len;
    int fallback = 0;
    for (Py_ssize_t i = 0; i < n && !fallback; i++) {
        const unsigned char *rec = B + i * L.insn;
        uint32_t id;
        memcpy(&id, rec, 4);
        int c = id < (uint32_t)classes.len ? cls[id] : 0;
        if (!c)
            continue;
        const unsigned char *ib = rec + L.bytes;
        if (c == C_MOVE && (mov_rm(ib[0]) || (ib[0] >= 0x40 && ib[0] <= 0x4F && mov_rm(ib[1]))))
            continue;
        const char *mnem = (const char *)rec + L.mnem, *ops = (const char *)rec + L.ops;
        size_t mlen, olen;
        if (text_len(mnem, L.mnem_len, &mlen) < 0 || text_len(ops, L.ops_len, &olen) < 0 || mlen == 0) {
            fallback = 1;
            break;
        }
        uint64_t addr;
        uint16_t size;
        memcpy(&addr, rec + 8, 8);
        memcpy(&size, rec + 16, 2);
        if (c == C_BRANCH) {
            int is_call, is_jmp;
            char c0 = mnem[0];
            if (id == L.call_id || id == L.jmp_id) {
                if (!strchr("jcbn", c0))
                    continue;
                is_call = id == L.call_id;
                is_jmp = !is_call;
            } else if (id < (uint32_t)jcc.len && jc[id]) {
                if (c0 != 'j')
                    continue;
                is_call = is_jmp = 0;
            } else {
                is_call = mlen >= 4 && memcmp(mnem + mlen - 4, "call", 4) == 0;
                is_jmp = mlen >= 3 && memcmp(mnem + mlen - 3, "jmp", 3) == 0;
                if (!strchr("jcbn", c0) || !(is_call || is_jmp || c0 == 'j'))
                    continue;
            }
            if (!local_jumps && !is_call) {
                unsigned char op = ib[0];
                if (size == 2 && ((op >= 0x70 && op <= 0x7F) || op == 0xEB)) {
                    uint64_t t = addr + 2 + (uint64_t)(int64_t)(int8_t)ib[1];
                    if (base <= t && t < end)
                        continue;
                } else if ((size == 5 && op == 0xE9) || (size == 6 && op == 0x0F && ib[1] >= 0x80 && ib[1] <= 0x8F)) {
                    int32_t rel;
                    memcpy(&rel, ib + size - 4, 4);
                    uint64_t t = addr + size + (uint64_t)(int64_t)rel;
                    if (base <= t && t < end)
                        continue;
                }
            }
            uint64_t target = 0;
            int imm = parse_number(ops, olen, &target);
            if (imm < 0) {
                fallback = 1;
                break;
            }
            if (imm && !local_jumps && !is_call && base <= target && target < end)
                continue;
            uint64_t off = addr - base;
            Py_ssize_t lo = off < (uint64_t)code.len ? (Py_ssize_t)off : code.len;
            Py_ssize_t hi = off + size < (uint64_t)code.len ? (Py_ssize_t)(off + size) : code.len;
            PyObject *fields[7] = {NULL};
            fields[0] = PyLong_FromUnsignedLongLong(addr);
            fields[1] = PyLong_FromLong(size);
            fields[2] = PyBytes_FromStringAndSize((const char *)C + lo, hi - lo);
            fields[3] = PyBool_FromLong(is_call);
            fields[4] = PyBool_FromLong(imm && !(is_call || is_jmp));
            fields[5] = imm ? PyLong_FromUnsignedLongLong(target) : Py_NewRef(Py_None);
            fields[6] = PyUnicode_DecodeASCII(ops, (Py_ssize_t)olen, NULL);
            PyObject *b = NULL;
            if (fields[0] && fields[1] && fields[2] && fields[5] && fields[6]) {
                if (imm)
                    PyUnicode_InternInPlace(&fields[6]);
                if (as_tuple) { /* the NamedTuple's own tuple, filled in place: no __new__ call */
                    b = ((PyTypeObject *)branch_type)->tp_alloc((PyTypeObject *)branch_type, 7);
                    if (b) {
                        for (int k = 0; k < 7; k++) {
                            PyTuple_SET_ITEM(b, k, fields[k]);
                            fields[k] = NULL;
                        }
                    }
                } else {
                    b = PyObject_Vectorcall(branch_type, fields, 7, NULL);
                }
            }
            for (int k = 0; k < 7; k++)
                Py_XDECREF(fields[k]);
            if (!b || PyList_Append(branches, b) < 0) {
                Py_XDECREF(b);
                goto done;
            }
            Py_DECREF(b);
            continue;
        }
        if (c == C_MOVE) {
            if (!((mlen == 3 && memcmp(mnem, "mov", 3) == 0) || (mlen == 6 && memcmp(mnem, "movabs", 6) == 0)))
                continue;
            /* ", 0x" somewhere, then _TRAILING_IMM: the text after the last ", " is a number */
            int has = 0;
            for (size_t p = 0; p + 4 <= olen; p++)
                if (memcmp(ops + p, ", 0x", 4) == 0) {
                    has = 1;
                    break;
                }
            if (!has)
                continue;
            size_t p = olen;
            while (p >= 2 && !(ops[p - 2] == ',' && ops[p - 1] == ' '))
                p--;
            if (p < 2)
                continue;
            uint64_t v;
            int r = parse_number(ops + p, olen - p, &v);
            if (r < 0) {
                fallback = 1;
                break;
            }
            if (r && v > 0x1000 && append_int(refs, v) < 0)
                goto done;
            continue;
        }
        if (mlen == 3 && memcmp(mnem, "lea", 3) == 0) {
            int64_t disp;
            int r = rip_disp(ops, olen, &disp);
            if (r < 0) {
                fallback = 1;
                break;
            }
            if (r) {
                PyObject *o = PyLong_FromUnsignedLongLong(addr + size);
                PyObject *d = o ? PyLong_FromLongLong(disp) : NULL;
                PyObject *sum = d ? PyNumber_Add(o, d) : NULL;
                Py_XDECREF(o);
                Py_XDECREF(d);
                if (!sum || PyList_Append(refs, sum) < 0) {
                    Py_XDECREF(sum);
                    goto done;
                }
                Py_DECREF(sum);
            }
        } else if (mlen == 4 && memcmp(mnem, "push", 4) == 0) {
            uint64_t v;
            int r = parse_number(ops, olen, &v);
            if (r < 0) {
                fallback = 1;
                break;
            }
            if (r && v > 0x1000 && append_int(refs, v) < 0)
                goto done;
        }
    }
    if (fallback)
        result = Py_NewRef(Py_None);
    else
        result = PyTuple_Pack(2, branches, refs);
done:
    Py_XDECREF(branches);
    Py_XDECREF(refs);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&code);
    PyBuffer_Release(&classes);
    PyBuffer_Release(&jcc);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "sweep()'s loop over capstone's cs_insn records (see disasm.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "csweep", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_csweep(void) { return PyModule_Create(&module); }
