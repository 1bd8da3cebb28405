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

/* scan's decision on one cs_insn record: 0 decided (a branch or reference appended, or nothing), 1 a
   form Python decides otherwise (fall back), -1 a Python error */
typedef struct {
    layout_t L;
    const unsigned char *C, *cls, *jc;
    Py_ssize_t code_len, ncls, njcc;
    uint64_t base, end;
    int local_jumps, as_tuple;
    PyObject *branch_type, *branches, *refs;
} scan_ctx;

static int scan_rec(const scan_ctx *x, const unsigned char *rec)
{
    const layout_t L = x->L;
    const unsigned char *C = x->C, *cls = x->cls, *jc = x->jc;
    const uint64_t base = x->base, end = x->end;
    const int local_jumps = x->local_jumps, as_tuple = x->as_tuple;
    PyObject *branch_type = x->branch_type, *branches = x->branches, *refs = x->refs;
    uint32_t id;
    memcpy(&id, rec, 4);
    int c = id < (uint32_t)x->ncls ? cls[id] : 0;
    if (!c)
        return 0;
    const unsigned char *ib = rec + L.bytes;
    if (c == C_MOVE && (mov_rm(ib[0]) || (ib[0] >= 0x40 && ib[0] <= 0x4F && mov_rm(ib[1]))))
        return 0;
    const char *mnem = (const char *)rec + L.mnem, *ops = (const char *)rec + L.ops;
    size_t mlen, olen;
    if (text_len(mnem, L.mnem_len, &mlen) < 0 || text_len(ops, L.ops_len, &olen) < 0 || mlen == 0) {
        return 1;
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
                return 0;
            is_call = id == L.call_id;
            is_jmp = !is_call;
        } else if (id < (uint32_t)x->njcc && jc[id]) {
            if (c0 != 'j')
                return 0;
            is_call = is_jmp = 0;
        } else {
            is_call = mlen >= 4 && memcmp(mnem + mlen - 4, "call", 4) == 0;
            is_jmp = mlen >= 3 && memcmp(mnem + mlen - 3, "jmp", 3) == 0;
            if (!strchr("jcbn", c0) || !(is_call || is_jmp || c0 == 'j'))
                return 0;
        }
        if (!local_jumps && !is_call) {
            unsigned char op = ib[0];
            if (size == 2 && ((op >= 0x70 && op <= 0x7F) || op == 0xEB)) {
                uint64_t t = addr + 2 + (uint64_t)(int64_t)(int8_t)ib[1];
                if (base <= t && t < end)
                    return 0;
            } else if ((size == 5 && op == 0xE9) || (size == 6 && op == 0x0F && ib[1] >= 0x80 && ib[1] <= 0x8F)) {
                int32_t rel;
                memcpy(&rel, ib + size - 4, 4);
                uint64_t t = addr + size + (uint64_t)(int64_t)rel;
                if (base <= t && t < end)
                    return 0;
            }
        }
        uint64_t target = 0;
        int imm = parse_number(ops, olen, &target);
        if (imm < 0) {
            return 1;
        }
        if (imm && !local_jumps && !is_call && base <= target && target < end)
            return 0;
        uint64_t off = addr - base;
        Py_ssize_t lo = off < (uint64_t)x->code_len ? (Py_ssize_t)off : x->code_len;
        Py_ssize_t hi = off + size < (uint64_t)x->code_len ? (Py_ssize_t)(off + size) : x->code_len;
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
            return -1;
        }
        Py_DECREF(b);
        return 0;
    }
    if (c == C_MOVE) {
        if (!((mlen == 3 && memcmp(mnem, "mov", 3) == 0) || (mlen == 6 && memcmp(mnem, "movabs", 6) == 0)))
            return 0;
        /* ", 0x" somewhere, then _TRAILING_IMM: the text after the last ", " is a number */
        int has = 0;
        for (size_t p = 0; p + 4 <= olen; p++)
            if (memcmp(ops + p, ", 0x", 4) == 0) {
                has = 1;
                break;
            }
        if (!has)
            return 0;
        size_t p = olen;
        while (p >= 2 && !(ops[p - 2] == ',' && ops[p - 1] == ' '))
            p--;
        if (p < 2)
            return 0;
        uint64_t v;
        int r = parse_number(ops + p, olen - p, &v);
        if (r < 0) {
            return 1;
        }
        if (r && v > 0x1000 && append_int(refs, v) < 0)
            return -1;
        return 0;
    }
    if (mlen == 3 && memcmp(mnem, "lea", 3) == 0) {
        int64_t disp;
        int r = rip_disp(ops, olen, &disp);
        if (r < 0) {
            return 1;
        }
        if (r) {
            PyObject *o = PyLong_FromUnsignedLongLong(addr + size);
            PyObject *d = o ? PyLong_FromLongLong(disp) : NULL;
            PyObject *sum = d ? PyNumber_Add(o, d) : NULL;
            Py_XDECREF(o);
            Py_XDECREF(d);
            if (!sum || PyList_Append(refs, sum) < 0) {
                Py_XDECREF(sum);
                return -1;
            }
            Py_DECREF(sum);
        }
    } else if (mlen == 4 && memcmp(mnem, "push", 4) == 0) {
        uint64_t v;
        int r = parse_number(ops, olen, &v);
        if (r < 0) {
            return 1;
        }
        if (r && v > 0x1000 && append_int(refs, v) < 0)
            return -1;
    }
    return 0;
}

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
    scan_ctx x = {L, code.buf, classes.buf, jcc.buf, code.len, classes.len, jcc.len, base,
                  base + (uint64_t)code.len, local_jumps, as_tuple, branch_type, branches, refs};
    const unsigned char *B = buf.buf;
    int fallback = 0;
    for (Py_ssize_t i = 0; i < n && !fallback; i++) {
        int r = scan_rec(&x, B + i * L.insn);
        if (r < 0)
            goto done;
        fallback = r;
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

/* sweep(handle, disasm_iter, insn_malloc, insn_free, code, base, local_jumps, classes, jcc, layout, branch)
 *   -> (branches, refs, instructions) or None
 * scan() over capstone's cs_disasm_iter instead of a cs_insn array: cs_disasm builds every record of a
 * range in one growing array (node: 7M records of 240 bytes, copied again into a Python bytes object),
 * where one record reused for each instruction stays in the cache.  handle is the Cs object's csh;
 * disasm_iter, insn_malloc, insn_free the addresses of cs_disasm_iter, cs_malloc and cs_free in the
 * capstone library the Python binding loaded.  None: a record scan() would leave to Python. */
typedef int (*disasm_iter_fn)(size_t handle, const uint8_t **code, size_t *size, uint64_t *address, void *insn);
typedef void *(*insn_malloc_fn)(size_t handle);
typedef void (*insn_free_fn)(void *insn, size_t count);

static PyObject *sweep(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer code, classes, jcc;
    unsigned long long handle, f_iter, f_malloc, f_free, base;
    int local_jumps;
    PyObject *lay, *branch_type;
    if (!PyArg_ParseTuple(args, "KKKKy*Kpy*y*OO", &handle, &f_iter, &f_malloc, &f_free, &code, &base,
                          &local_jumps, &classes, &jcc, &lay, &branch_type))
        return NULL;
    PyObject *branches = NULL, *refs = NULL, *result = NULL;
    void *insn = NULL;
    layout_t L;
    if (!PyArg_ParseTuple(lay, "nnnnnnkk", &L.insn, &L.mnem, &L.ops, &L.bytes, &L.mnem_len, &L.ops_len,
                          &L.call_id, &L.jmp_id))
        goto done;
    if (!f_iter || !f_malloc || !f_free || L.insn < 24 || L.mnem + L.mnem_len > L.insn ||
        L.ops + L.ops_len > L.insn || L.bytes + 24 > L.insn) {
        PyErr_SetString(PyExc_ValueError, "csweep.sweep: bad record layout or capstone entry points");
        goto done;
    }
    branches = PyList_New(0);
    refs = PyList_New(0);
    if (!branches || !refs)
        goto done;
    int as_tuple = PyType_Check(branch_type) &&
                   PyType_IsSubtype((PyTypeObject *)branch_type, &PyTuple_Type) &&
                   ((PyTypeObject *)branch_type)->tp_basicsize == PyTuple_Type.tp_basicsize &&
                   ((PyTypeObject *)branch_type)->tp_dictoffset == 0;
    scan_ctx x = {L, code.buf, classes.buf, jcc.buf, code.len, classes.len, jcc.len, base,
                  base + (uint64_t)code.len, local_jumps, as_tuple, branch_type, branches, refs};
    disasm_iter_fn disasm_iter = (disasm_iter_fn)(uintptr_t)f_iter;
    insn = ((insn_malloc_fn)(uintptr_t)f_malloc)((size_t)handle);
    if (!insn) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *p = code.buf;
    size_t left = (size_t)code.len;
    uint64_t address = base;
    unsigned long long n = 0;
    int fallback = 0;
    while (!fallback && disasm_iter((size_t)handle, &p, &left, &address, insn)) {
        n++;
        int r = scan_rec(&x, insn);
        if (r < 0)
            goto done;
        fallback = r;
    }
    if (fallback)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("(OOK)", branches, refs, n);
done:
    if (insn)
        ((insn_free_fn)(uintptr_t)f_free)(insn, 1);
    Py_XDECREF(branches);
    Py_XDECREF(refs);
    PyBuffer_Release(&code);
    PyBuffer_Release(&classes);
    PyBuffer_Release(&jcc);
    return result;
}

/* ------------------------------------------------------------------------------------ site rows
 * site_rows(parts, starts, starts_q, ends_q, owner, plt_q, plt_node, kinds, sites, out) -> None
 * analysis._site_row and GraphRows.add_call for every branch of every swept function, in order:
 *   parts[i]: the branches (Branch tuples) swept from the i-th function [starts[i], ends[i]); each list
 *     is emptied once its rows are built (node: its branches and its rows are ~100 MB each);
 *   starts: the sorted function starts (ints), starts_q / ends_q: the same starts and their ends as
 *     native uint64 arrays; owner: fragment start -> owning function start;
 *   plt_q: [lo, hi) pairs of the PLT sections (uint64); plt_node(target) -> the external node of a
 *     PLT stub (called in branch order, so externals are numbered as the Python loop numbers them);
 *   kinds: the strings ("direct", "plt", "tail", "indirect");
 *   sites: GraphRows.sites (rows appended), out: GraphRows' source -> edge rows (rows appended). */
typedef struct {
    const uint64_t *starts, *ends;
    Py_ssize_t n;
} ftable_t;

/* index of the function containing addr, -1 if none (FunctionTable.containing) */
static Py_ssize_t containing(const ftable_t *t, uint64_t addr)
{
    Py_ssize_t lo = 0, hi = t->n;
    while (lo < hi) { /* bisect_right */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (addr < t->starts[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    lo -= 1;
    return lo >= 0 && addr < t->ends[lo] ? lo : -1;
}

/* index of the function starting at addr, -1 if none (addr in FunctionTable.by_start) */
static Py_ssize_t start_index(const ftable_t *t, uint64_t addr)
{
    Py_ssize_t lo = 0, hi = t->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t->starts[mid] < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < t->n && t->starts[lo] == addr ? lo : -1;
}

/* owner.get(start, start): a borrowed reference */
static PyObject *owner_of(PyObject *owner, PyObject *start)
{
    PyObject *o = PyDict_GetItemWithError(owner, start);
    return o ? o : (PyErr_Occurred() ? NULL : start);
}

static PyObject *hex_of(PyObject *raw)
{
    static const char digits[] = "0123456789abcdef";
    Py_ssize_t n = PyBytes_GET_SIZE(raw);
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(raw);
    PyObject *s = PyUnicode_New(2 * n, 127);
    if (!s)
        return NULL;
    Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        d[2 * i] = (Py_UCS1)digits[p[i] >> 4];
        d[2 * i + 1] = (Py_UCS1)digits[p[i] & 15];
    }
    return s;
}

static int u64_of(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* the row [caller, address, ret, length, hex, kind, target, operand, is_jump]; steals nothing */
static PyObject *site_row(PyObject *caller, PyObject *b, uint64_t address, PyObject *kind, PyObject *target,
                          PyObject *operand, int is_jump)
{
    PyObject *length = PyTuple_GET_ITEM(b, 1), *raw = PyTuple_GET_ITEM(b, 2);
    uint64_t len;
    if (u64_of(length, &len) < 0)
        return NULL;
    if (!PyBytes_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "csweep.site_rows: a branch's bytes are not bytes");
        return NULL;
    }
    PyObject *ret = PyLong_FromUnsignedLongLong(address + len);
    PyObject *hex = ret ? hex_of(raw) : NULL;
    PyObject *row = hex ? PyList_New(9) : NULL;
    if (!row) {
        Py_XDECREF(ret);
        Py_XDECREF(hex);
        return NULL;
    }
    PyObject *items[9] = {caller, PyTuple_GET_ITEM(b, 0), ret, length, hex, kind, target, operand,
                          is_jump ? Py_True : Py_False};
    for (int k = 0; k < 9; k++) {
        if (k != 2 && k != 4)
            Py_INCREF(items[k]);
        PyList_SET_ITEM(row, k, items[k]);
    }
    return row;
}

/* GraphRows.add_call */
static int add_call(PyObject *row, PyObject *sites, PyObject *out)
{
    if (PyList_Append(sites, row) < 0)
        return -1;
    PyObject *target = PyList_GET_ITEM(row, 6);
    if (target == Py_None)
        return 0;
    PyObject *function = PyList_GET_ITEM(row, 0);
    PyObject *edges = PyDict_GetItemWithError(out, function);
    if (!edges) {
        if (PyErr_Occurred())
            return -1;
        edges = PyList_New(0);
        if (!edges)
            return -1;
        int r = PyDict_SetItem(out, function, edges);
        Py_DECREF(edges); /* the dict holds it */
        if (r < 0)
            return -1;
    }
    PyObject *edge = PyList_New(8);
    if (!edge)
        return -1;
    PyObject *items[8] = {function, target, PyList_GET_ITEM(row, 1), PyList_GET_ITEM(row, 5),
                          PyList_GET_ITEM(row, 1), PyList_GET_ITEM(row, 2), PyList_GET_ITEM(row, 3), Py_None};
    for (int k = 0; k < 8; k++) {
        Py_INCREF(items[k]);
        PyList_SET_ITEM(edge, k, items[k]);
    }
    int r = PyList_Append(edges, edge);
    Py_DECREF(edge);
    return r;
}

static PyObject *site_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts, *starts, *owner, *plt_node, *kinds, *sites, *out;
    Py_buffer sq, eq, pq;
    if (!PyArg_ParseTuple(args, "O!O!y*y*O!y*OO!O!O!", &PyList_Type, &parts, &PyList_Type, &starts, &sq, &eq,
                          &PyDict_Type, &owner, &pq, &plt_node, &PyTuple_Type, &kinds, &PyList_Type, &sites,
                          &PyDict_Type, &out))
        return NULL;
    PyObject *result = NULL;
    ftable_t t = {sq.buf, eq.buf, PyList_GET_SIZE(starts)};
    const uint64_t *plt = pq.buf;
    Py_ssize_t nplt = pq.len / 16;
    if (sq.len != t.n * 8 || eq.len != t.n * 8 || PyList_GET_SIZE(parts) != t.n || PyTuple_GET_SIZE(kinds) != 4) {
        PyErr_SetString(PyExc_ValueError, "csweep.site_rows: inconsistent tables");
        goto done;
    }
    PyObject *k_direct = PyTuple_GET_ITEM(kinds, 0), *k_plt = PyTuple_GET_ITEM(kinds, 1),
             *k_tail = PyTuple_GET_ITEM(kinds, 2), *k_indirect = PyTuple_GET_ITEM(kinds, 3);
    uint64_t plt_lo = UINT64_MAX, plt_hi = 0;
    for (Py_ssize_t k = 0; k < nplt; k++) {
        if (plt[2 * k] < plt_lo)
            plt_lo = plt[2 * k];
        if (plt[2 * k + 1] > plt_hi)
            plt_hi = plt[2 * k + 1];
    }
    for (Py_ssize_t i = 0; i < t.n; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        if (!PyList_Check(part)) {
            PyErr_SetString(PyExc_TypeError, "csweep.site_rows: a part is not a list");
            goto done;
        }
        PyObject *own = owner_of(owner, PyList_GET_ITEM(starts, i));
        if (!own)
            goto done;
        uint64_t start = t.starts[i], end = t.ends[i];
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(part); j++) {
            PyObject *b = PyList_GET_ITEM(part, j);
            if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 7) {
                PyErr_SetString(PyExc_TypeError, "csweep.site_rows: a branch is not a 7-tuple");
                goto done;
            }
            uint64_t address;
            if (u64_of(PyTuple_GET_ITEM(b, 0), &address) < 0)
                goto done;
            PyObject *caller = own;
            if (!(start <= address && address < end)) {
                Py_ssize_t c = containing(&t, address);
                if (c < 0)
                    continue; /* cannot happen: every swept byte belongs to a function range */
                caller = owner_of(owner, PyList_GET_ITEM(starts, c));
                if (!caller)
                    goto done;
            }
            int is_call = PyObject_IsTrue(PyTuple_GET_ITEM(b, 3));
            if (is_call < 0)
                goto done;
            PyObject *tgt = PyTuple_GET_ITEM(b, 5), *operand = PyTuple_GET_ITEM(b, 6), *row = NULL;
            if (tgt == Py_None) {
                row = site_row(caller, b, address, k_indirect, Py_None, operand, !is_call);
            } else {
                uint64_t target;
                if (u64_of(tgt, &target) < 0)
                    goto done;
                int in_plt = 0;
                if (plt_lo <= target && target < plt_hi)
                    for (Py_ssize_t k = 0; k < nplt && !in_plt; k++)
                        in_plt = plt[2 * k] <= target && target < plt[2 * k + 1];
                if (in_plt) {
                    PyObject *node = PyObject_CallOneArg(plt_node, tgt);
                    if (!node)
                        goto done;
                    row = site_row(caller, b, address, is_call ? k_plt : k_tail, node, Py_None, !is_call);
                    Py_DECREF(node);
                } else if (is_call) {
                    Py_ssize_t c = start_index(&t, target);
                    if (c < 0)
                        c = containing(&t, target);
                    if (c < 0) { /* a call out of the code sections: treated like an unknown target */
                        row = site_row(caller, b, address, k_indirect, Py_None, operand, 0);
                    } else {
                        PyObject *callee = owner_of(owner, PyList_GET_ITEM(starts, c));
                        if (!callee)
                            goto done;
                        row = site_row(caller, b, address, k_direct, callee, Py_None, 0);
                    }
                } else {
                    /* a jump: a tail call when it lands on another function's entry, not on a fragment
                       it owns */
                    if (start_index(&t, target) < 0)
                        continue;
                    int owned = PyDict_Contains(owner, tgt);
                    if (owned < 0)
                        goto done;
                    if (owned)
                        continue;
                    uint64_t caller_addr;
                    if (u64_of(caller, &caller_addr) < 0)
                        goto done;
                    if (caller_addr == target)
                        continue;
                    row = site_row(caller, b, address, k_tail, tgt, Py_None, 1);
                }
            }
            if (!row)
                goto done;
            int r = add_call(row, sites, out);
            Py_DECREF(row);
            if (r < 0)
                goto done;
        }
        if (PyList_SetSlice(part, 0, PyList_GET_SIZE(part), NULL) < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&sq);
    PyBuffer_Release(&eq);
    PyBuffer_Release(&pq);
    return result;
}

/* ------------------------------------------------------------------------------------ sweep rounds
 * round_facts(parts, ranges_q, starts_q, plt_q) -> (jumps, calls)
 * What analysis._sweep_all takes from the branches of the functions swept in one round:
 *   parts[i]: the branches swept from [ranges_q[2i], ranges_q[2i+1]);
 *   jumps[i]: the targets of its direct unconditional jumps out of that range (an empty tuple if none);
 *   calls: the direct call targets, in branch order, that are neither a start in starts_q (the sorted
 *     function starts when the round began) nor in a PLT range of plt_q. */
static PyObject *round_facts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts;
    Py_buffer rq, sq, pq;
    if (!PyArg_ParseTuple(args, "O!y*y*y*", &PyList_Type, &parts, &rq, &sq, &pq))
        return NULL;
    PyObject *jumps = NULL, *calls = NULL, *result = NULL, *empty = PyTuple_New(0);
    Py_ssize_t n = PyList_GET_SIZE(parts), nplt = pq.len / 16;
    const uint64_t *ranges = rq.buf, *plt = pq.buf;
    ftable_t t = {sq.buf, sq.buf, sq.len / 8};
    if (!empty)
        goto done;
    if (rq.len != n * 16) {
        PyErr_SetString(PyExc_ValueError, "csweep.round_facts: one range per part");
        goto done;
    }
    jumps = PyList_New(n);
    calls = PyList_New(0);
    if (!jumps || !calls)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i), *mine = NULL;
        if (!PyList_Check(part)) {
            PyErr_SetString(PyExc_TypeError, "csweep.round_facts: a part is not a list");
            goto done;
        }
        uint64_t lo = ranges[2 * i], hi = ranges[2 * i + 1];
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(part); j++) {
            PyObject *b = PyList_GET_ITEM(part, j);
            if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 7) {
                PyErr_SetString(PyExc_TypeError, "csweep.round_facts: a branch is not a 7-tuple");
                Py_XDECREF(mine);
                goto done;
            }
            PyObject *tgt = PyTuple_GET_ITEM(b, 5);
            if (tgt == Py_None)
                continue;
            int is_call = PyObject_IsTrue(PyTuple_GET_ITEM(b, 3));
            int conditional = is_call < 0 ? -1 : PyObject_IsTrue(PyTuple_GET_ITEM(b, 4));
            uint64_t target;
            if (conditional < 0 || u64_of(tgt, &target) < 0) {
                Py_XDECREF(mine);
                goto done;
            }
            if (is_call) {
                if (start_index(&t, target) >= 0)
                    continue;
                int in_plt = 0;
                for (Py_ssize_t k = 0; k < nplt && !in_plt; k++)
                    in_plt = plt[2 * k] <= target && target < plt[2 * k + 1];
                if (!in_plt && PyList_Append(calls, tgt) < 0) {
                    Py_XDECREF(mine);
                    goto done;
                }
            } else if (!conditional && !(lo <= target && target < hi)) {
                if (!mine && !(mine = PyList_New(0)))
                    goto done;
                if (PyList_Append(mine, tgt) < 0) {
                    Py_DECREF(mine);
                    goto done;
                }
            }
        }
        PyList_SET_ITEM(jumps, i, mine ? mine : Py_NewRef(empty));
    }
    result = PyTuple_Pack(2, jumps, calls);
done:
    Py_XDECREF(empty);
    Py_XDECREF(jumps);
    Py_XDECREF(calls);
    PyBuffer_Release(&rq);
    PyBuffer_Release(&sq);
    PyBuffer_Release(&pq);
    return result;
}

/* first_non_padding(handle, disasm_iter, insn_malloc, insn_free, code, base, layout) -> address or None
 * disasm.first_non_padding over cs_disasm_iter: the first instruction that is not nop, int3, a skipped
 * byte (.byte), xchg ax, ax, a prefixed nop or zero fill (add byte ptr [rax], al on 00 00). */
static PyObject *first_non_padding(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer code;
    unsigned long long handle, f_iter, f_malloc, f_free, base;
    PyObject *lay;
    if (!PyArg_ParseTuple(args, "KKKKy*KO", &handle, &f_iter, &f_malloc, &f_free, &code, &base, &lay))
        return NULL;
    PyObject *result = NULL;
    void *insn = NULL;
    layout_t L;
    if (!PyArg_ParseTuple(lay, "nnnnnnkk", &L.insn, &L.mnem, &L.ops, &L.bytes, &L.mnem_len, &L.ops_len,
                          &L.call_id, &L.jmp_id))
        goto done;
    if (!f_iter || !f_malloc || !f_free || L.mnem + L.mnem_len > L.insn || L.ops + L.ops_len > L.insn) {
        PyErr_SetString(PyExc_ValueError, "csweep.first_non_padding: bad record layout or entry points");
        goto done;
    }
    insn = ((insn_malloc_fn)(uintptr_t)f_malloc)((size_t)handle);
    if (!insn) {
        PyErr_NoMemory();
        goto done;
    }
    disasm_iter_fn disasm_iter = (disasm_iter_fn)(uintptr_t)f_iter;
    const uint8_t *p = code.buf, *c = code.buf;
    size_t left = (size_t)code.len;
    uint64_t address = base;
    while (1) {
        uint64_t at = address;
        if (!disasm_iter((size_t)handle, &p, &left, &address, insn)) {
            result = Py_NewRef(Py_None);
            break;
        }
        const char *rec = insn, *mnem = rec + L.mnem, *ops = rec + L.ops;
        size_t mlen, olen;
        if (text_len(mnem, L.mnem_len, &mlen) < 0 || text_len(ops, L.ops_len, &olen) < 0) {
            PyErr_SetString(PyExc_ValueError, "csweep.first_non_padding: unterminated text");
            break;
        }
        if ((mlen == 3 && memcmp(mnem, "nop", 3) == 0) || (mlen == 4 && memcmp(mnem, "int3", 4) == 0) ||
            (mlen == 5 && memcmp(mnem, ".byte", 5) == 0))
            continue;
        if (mlen == 4 && memcmp(mnem, "xchg", 4) == 0 && olen == 6 && memcmp(ops, "ax, ax", 6) == 0)
            continue;
        if (mlen >= 4 && memcmp(mnem + mlen - 4, " nop", 4) == 0)
            continue;
        uint64_t off = at - base;
        if (mlen == 3 && memcmp(mnem, "add", 3) == 0 && olen == 18 && memcmp(ops, "byte ptr [rax], al", 18) == 0 &&
            off + 2 <= (uint64_t)code.len && c[off] == 0 && c[off + 1] == 0)
            continue;
        result = PyLong_FromUnsignedLongLong(at);
        break;
    }
done:
    if (insn)
        ((insn_free_fn)(uintptr_t)f_free)(insn, 1);
    PyBuffer_Release(&code);
    return result;
}

/* table_words(words, base, width, segments_q) -> list of code addresses, or None
 * analysis._table_words's loop over the entries unpacked from one slice of the file: 8-byte absolute
 * addresses (width 8) or 4-byte signed offsets from base (width 4), up to the first that does not lie
 * in an executable PT_LOAD segment (segments_q: (vaddr, memsz, flags) triples sorted by vaddr, looked
 * up as AddressSpace.segment_of looks them up).  None: an address past 64 bits either way (Python
 * decides). */
static PyObject *table_words(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer words, segs;
    unsigned long long base;
    int width;
    if (!PyArg_ParseTuple(args, "y*Kiy*", &words, &base, &width, &segs))
        return NULL;
    PyObject *out = NULL;
    const uint64_t *sg = segs.buf;
    Py_ssize_t nseg = segs.len / 24;
    if ((width != 4 && width != 8) || segs.len % 24) {
        PyErr_SetString(PyExc_ValueError, "csweep.table_words: width 4 or 8, segment triples");
        goto done;
    }
    out = PyList_New(0);
    if (!out)
        goto done;
    const unsigned char *w = words.buf;
    for (Py_ssize_t i = 0; i + width <= words.len; i += width) {
        uint64_t word;
        if (width == 8) {
            memcpy(&word, w + i, 8);
        } else {
            int32_t rel;
            memcpy(&rel, w + i, 4);
            if ((rel < 0 && base < (uint64_t)(-(int64_t)rel)) || (rel > 0 && base > UINT64_MAX - (uint64_t)rel)) {
                Py_SETREF(out, Py_NewRef(Py_None));
                goto done;
            }
            word = base + (uint64_t)(int64_t)rel;
        }
        Py_ssize_t lo = 0, hi = nseg; /* bisect_right over the segment starts */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (word < sg[3 * mid])
                hi = mid;
            else
                lo = mid + 1;
        }
        lo -= 1;
        if (lo < 0 || sg[3 * lo] + sg[3 * lo + 1] < sg[3 * lo]) { /* a segment past 64 bits: Python decides */
            if (lo >= 0) {
                Py_SETREF(out, Py_NewRef(Py_None));
                goto done;
            }
            break;
        }
        if (!(word < sg[3 * lo] + sg[3 * lo + 1] && (sg[3 * lo + 2] & 1)))
            break;
        if (append_int(out, word) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    PyBuffer_Release(&words);
    PyBuffer_Release(&segs);
    return out;
}

/* retype(lists, cls) -> a new list of new lists, each tuple of each list copied as a cls (a tuple
 * subclass without extra fields, e.g. Branch, or tuple itself): what parallel.py sends through marshal
 * (which takes no tuple subclass) and takes back, without a Python call per branch. */
static PyObject *retype(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *lists, *cls;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &lists, &PyType_Type, &cls))
        return NULL;
    PyTypeObject *t = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(t, &PyTuple_Type) || t->tp_basicsize != PyTuple_Type.tp_basicsize || t->tp_dictoffset) {
        PyErr_SetString(PyExc_TypeError, "csweep.retype: not a plain tuple type");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(lists);
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *src = PyList_GET_ITEM(lists, i);
        if (!PyList_Check(src)) {
            PyErr_SetString(PyExc_TypeError, "csweep.retype: not a list");
            goto fail;
        }
        Py_ssize_t m = PyList_GET_SIZE(src);
        PyObject *dst = PyList_New(m);
        if (!dst)
            goto fail;
        PyList_SET_ITEM(out, i, dst);
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *tup = PyList_GET_ITEM(src, j);
            if (!PyTuple_Check(tup)) {
                PyErr_SetString(PyExc_TypeError, "csweep.retype: not a tuple");
                goto fail;
            }
            Py_ssize_t k = PyTuple_GET_SIZE(tup);
            PyObject *copy = t == &PyTuple_Type ? PyTuple_New(k) : t->tp_alloc(t, k);
            if (!copy)
                goto fail;
            for (Py_ssize_t e = 0; e < k; e++)
                PyTuple_SET_ITEM(copy, e, Py_NewRef(PyTuple_GET_ITEM(tup, e)));
            PyList_SET_ITEM(dst, j, copy);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* refs_in(ordered, regions) -> the items of ordered (sorted ints) inside any [lo, hi) of regions (a list
 * of (lo, hi) pairs, in any order, possibly nested), in order: analysis._refs_in's reference loop. */
typedef struct {
    uint64_t lo, hi;
} region_t;

static int region_cmp(const void *a, const void *b)
{
    const region_t *x = a, *y = b;
    if (x->lo != y->lo)
        return x->lo < y->lo ? -1 : 1;
    return x->hi < y->hi ? -1 : x->hi > y->hi;
}

static PyObject *refs_in(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ordered, *regions;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &ordered, &PyList_Type, &regions))
        return NULL;
    Py_ssize_t nr = PyList_GET_SIZE(regions), n = PyList_GET_SIZE(ordered);
    region_t *r = PyMem_Malloc(sizeof(region_t) * (size_t)(nr + 1));
    PyObject *out = NULL;
    if (!r)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *pair = PyList_GET_ITEM(regions, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || u64_of(PyTuple_GET_ITEM(pair, 0), &r[i].lo) < 0 ||
            u64_of(PyTuple_GET_ITEM(pair, 1), &r[i].hi) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "csweep.refs_in: regions are (lo, hi) pairs");
            goto done;
        }
    }
    qsort(r, (size_t)nr, sizeof(region_t), region_cmp);
    out = PyList_New(0);
    if (!out)
        goto done;
    Py_ssize_t j = 0;
    uint64_t prev = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (u64_of(PyList_GET_ITEM(ordered, i), &v) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                Py_CLEAR(out);
                goto done;
            }
            PyErr_Clear(); /* a negative reference (or one past 64 bits): in no region */
            continue;
        }
        if (i && v < prev) {
            PyErr_SetString(PyExc_ValueError, "csweep.refs_in: references not sorted");
            Py_CLEAR(out);
            goto done;
        }
        prev = v;
        /* regions sorted by lo: skip those ending at or before v; nested ones end inside an earlier one */
        while (j < nr && r[j].hi <= v)
            j++;
        int inside = 0;
        for (Py_ssize_t k = j; k < nr && r[k].lo <= v && !inside; k++)
            inside = v < r[k].hi;
        if (inside && PyList_Append(out, PyList_GET_ITEM(ordered, i)) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    PyMem_Free(r);
    return out;
}

/* indirect_jumps(parts) -> for each list of branches, the operand texts of its indirect jumps (not
 * calls, no target), in order, or None if it has none */
static PyObject *indirect_jumps(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &parts))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i), *mine = NULL;
        if (!PyList_Check(part)) {
            PyErr_SetString(PyExc_TypeError, "csweep.indirect_jumps: a part is not a list");
            goto fail;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(part); j++) {
            PyObject *b = PyList_GET_ITEM(part, j);
            if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 7) {
                PyErr_SetString(PyExc_TypeError, "csweep.indirect_jumps: a branch is not a 7-tuple");
                Py_XDECREF(mine);
                goto fail;
            }
            if (PyTuple_GET_ITEM(b, 5) != Py_None)
                continue;
            int is_call = PyObject_IsTrue(PyTuple_GET_ITEM(b, 3));
            if (is_call < 0 || (!is_call && ((!mine && !(mine = PyList_New(0))) ||
                                             PyList_Append(mine, PyTuple_GET_ITEM(b, 6)) < 0))) {
                Py_XDECREF(mine);
                goto fail;
            }
        }
        PyList_SET_ITEM(out, i, mine ? mine : Py_NewRef(Py_None));
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* data_refs_of(refs, segments_q) -> the refs (in order) that lie in a PT_LOAD segment that is not
 * executable (segments_q as for table_words), or None if a segment reaches past 64 bits */
static PyObject *data_refs_of(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *refs;
    Py_buffer segs;
    if (!PyArg_ParseTuple(args, "O!y*", &PyList_Type, &refs, &segs))
        return NULL;
    const uint64_t *sg = segs.buf;
    Py_ssize_t nseg = segs.len / 24;
    PyObject *out = PyList_New(0);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs); i++) {
        PyObject *o = PyList_GET_ITEM(refs, i);
        uint64_t v;
        if (u64_of(o, &v) < 0) {
            PyErr_Clear(); /* a negative or huge reference: in no segment */
            continue;
        }
        Py_ssize_t lo = 0, hi = nseg;
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (v < sg[3 * mid])
                hi = mid;
            else
                lo = mid + 1;
        }
        lo -= 1;
        if (lo < 0)
            continue;
        if (sg[3 * lo] + sg[3 * lo + 1] < sg[3 * lo]) {
            Py_SETREF(out, Py_NewRef(Py_None));
            goto done;
        }
        if (v < sg[3 * lo] + sg[3 * lo + 1] && !(sg[3 * lo + 2] & 1) && PyList_Append(out, o) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    PyBuffer_Release(&segs);
    return out;
}

/* group_edges(rows) -> the edge rows of one source in networkx's order (GraphRows.serial): by target,
 * first edge to each target first, then by key (row[2]); a key added again replaces its row in place.
 * None for more than 64 rows (the quadratic walk here is for the many short lists; Python does the rest). */
static PyObject *group_edges(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *rows;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &rows))
        return NULL;
    Py_ssize_t k = PyList_GET_SIZE(rows);
    if (k > 64)
        Py_RETURN_NONE;
    PyObject *slot[64];
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyList_Check(row) || PyList_GET_SIZE(row) < 3) {
            PyErr_SetString(PyExc_TypeError, "csweep.group_edges: an edge row is not a list");
            return NULL;
        }
        PyObject *t = PyList_GET_ITEM(row, 1), *key = PyList_GET_ITEM(row, 2);
        Py_ssize_t last_same = -1, same_key = -1;
        for (Py_ssize_t j = 0; j < n && same_key < 0; j++) {
            int eq = PyObject_RichCompareBool(PyList_GET_ITEM(slot[j], 1), t, Py_EQ);
            if (eq < 0)
                return NULL;
            if (!eq)
                continue;
            last_same = j;
            eq = PyObject_RichCompareBool(PyList_GET_ITEM(slot[j], 2), key, Py_EQ);
            if (eq < 0)
                return NULL;
            if (eq)
                same_key = j;
        }
        if (same_key >= 0) {
            slot[same_key] = row;
            continue;
        }
        if (last_same >= 0) { /* after the target's group, which is contiguous */
            while (last_same + 1 < n) {
                int eq = PyObject_RichCompareBool(PyList_GET_ITEM(slot[last_same + 1], 1), t, Py_EQ);
                if (eq < 0)
                    return NULL;
                if (!eq)
                    break;
                last_same++;
            }
            memmove(slot + last_same + 2, slot + last_same + 1, sizeof(PyObject *) * (size_t)(n - last_same - 1));
            slot[last_same + 1] = row;
        } else {
            slot[n] = row;
        }
        n++;
    }
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t j = 0; j < n; j++)
        PyList_SET_ITEM(out, j, Py_NewRef(slot[j]));
    return out;
}

/* fragment_entries(parts, starts, starts_q, ends_q, fragment) -> [(fragment start, entering start)]
 * analysis._fold_fragments's first loop: every direct jump (conditional or not) of parts[i], swept from
 * [starts_q[i], ends_q[i]), that lands outside that range in a function j flagged fragment[j] (one
 * byte per start), other than the jumping function itself, in branch order. */
static PyObject *fragment_entries(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts, *starts;
    Py_buffer sq, eq, fq;
    if (!PyArg_ParseTuple(args, "O!O!y*y*y*", &PyList_Type, &parts, &PyList_Type, &starts, &sq, &eq, &fq))
        return NULL;
    ftable_t t = {sq.buf, eq.buf, PyList_GET_SIZE(starts)};
    const unsigned char *frag = fq.buf;
    PyObject *out = NULL;
    if (sq.len != t.n * 8 || eq.len != t.n * 8 || fq.len != t.n || PyList_GET_SIZE(parts) != t.n) {
        PyErr_SetString(PyExc_ValueError, "csweep.fragment_entries: inconsistent tables");
        goto done;
    }
    out = PyList_New(0);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < t.n; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        if (!PyList_Check(part)) {
            PyErr_SetString(PyExc_TypeError, "csweep.fragment_entries: a part is not a list");
            Py_CLEAR(out);
            goto done;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(part); k++) {
            PyObject *b = PyList_GET_ITEM(part, k);
            if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 7) {
                PyErr_SetString(PyExc_TypeError, "csweep.fragment_entries: a branch is not a 7-tuple");
                Py_CLEAR(out);
                goto done;
            }
            PyObject *tgt = PyTuple_GET_ITEM(b, 5);
            if (tgt == Py_None)
                continue;
            int is_call = PyObject_IsTrue(PyTuple_GET_ITEM(b, 3));
            uint64_t target;
            if (is_call < 0 || u64_of(tgt, &target) < 0) {
                Py_CLEAR(out);
                goto done;
            }
            if (is_call || (t.starts[i] <= target && target < t.ends[i]))
                continue;
            Py_ssize_t j = containing(&t, target);
            if (j < 0 || !frag[j] || j == i)
                continue;
            PyObject *pair = PyTuple_Pack(2, PyList_GET_ITEM(starts, j), PyList_GET_ITEM(starts, i));
            if (!pair || PyList_Append(out, pair) < 0) {
                Py_XDECREF(pair);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(pair);
        }
    }
done:
    PyBuffer_Release(&sq);
    PyBuffer_Release(&eq);
    PyBuffer_Release(&fq);
    return out;
}

/* ------------------------------------------------------------------------------------ statistics
 * scc_counts(nodes, edges, root) -> (sccs, complex_sccs, cyclic_edges, call_edges)
 * stats._stats_of_rows's strongly connected components: nodes and edges are CallGraph.to_dict() rows
 * (node id first; edge source and target first); the counts are those of the components holding an
 * internal function (kind "function"), of those with a call edge inside them, and of such edges
 * (the virtual root's edges are no calls), and the count of call edges.  Tarjan's algorithm, iterative. */
/* site_counts(sites) -> (direct_calls, plt_calls, tail_calls, indirect_calls, indirect_jumps), as
 * stats._stats_of_rows counts them from CallGraph.to_dict()["sites"] rows */
static PyObject *site_counts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *sites;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &sites))
        return NULL;
    Py_ssize_t direct = 0, plt = 0, tail = 0, icall = 0, ijump = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sites); i++) {
        PyObject *s = PyList_GET_ITEM(sites, i);
        if (!PyList_Check(s) || PyList_GET_SIZE(s) != 9 || !PyUnicode_Check(PyList_GET_ITEM(s, 5)) ||
            !PyUnicode_Check(PyList_GET_ITEM(s, 4))) {
            PyErr_SetString(PyExc_TypeError, "csweep.site_counts: a site row is not a list of 9 fields");
            return NULL;
        }
        PyObject *kind = PyList_GET_ITEM(s, 5);
        int is_direct = PyUnicode_CompareWithASCIIString(kind, "direct") == 0;
        int is_plt = !is_direct && PyUnicode_CompareWithASCIIString(kind, "plt") == 0;
        if (is_plt)
            plt++;
        else if (!is_direct && PyUnicode_CompareWithASCIIString(kind, "tail") == 0)
            tail++;
        else if (!is_direct && PyUnicode_CompareWithASCIIString(kind, "indirect") == 0) {
            int j = PyObject_IsTrue(PyList_GET_ITEM(s, 8));
            if (j < 0)
                return NULL;
            if (j)
                ijump++;
            else
                icall++;
        }
        if (is_direct || is_plt) { /* s[3] >= 5 and s[4][-10:-8] == "e8": the rel32 call opcode */
            PyObject *hex = PyList_GET_ITEM(s, 4);
            long long length = PyLong_AsLongLong(PyList_GET_ITEM(s, 3));
            if (length == -1 && PyErr_Occurred())
                return NULL;
            int ge = length >= 5;
            Py_ssize_t hn = PyUnicode_GET_LENGTH(hex);
            if (ge && hn >= 10 && PyUnicode_READ_CHAR(hex, hn - 10) == 'e' &&
                PyUnicode_READ_CHAR(hex, hn - 9) == '8')
                direct++;
        }
    }
    return Py_BuildValue("(nnnnn)", direct, plt, tail, icall, ijump);
}

static PyObject *scc_counts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nodes, *edges, *root;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &nodes, &PyList_Type, &edges, &root))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(nodes), m = PyList_GET_SIZE(edges);
    PyObject *index_of = PyDict_New(), *result = NULL;
    Py_ssize_t *eu = NULL, *ev = NULL, *first = NULL, *adj = NULL, *idx = NULL, *low = NULL, *comp = NULL,
               *stack = NULL, *work = NULL, *pos = NULL;
    char *internal = NULL, *on_stack = NULL, *seen = NULL;
    if (!index_of)
        return NULL;
    eu = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m + 1));
    ev = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m + 1));
    first = PyMem_Calloc((size_t)n + 2, sizeof(Py_ssize_t));
    adj = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m + 1));
    idx = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    low = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    comp = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    stack = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    work = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    pos = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    internal = PyMem_Calloc((size_t)n + 1, 1);
    on_stack = PyMem_Calloc((size_t)n + 1, 1);
    seen = PyMem_Calloc((size_t)n + 1, 1);
    if (!eu || !ev || !first || !adj || !idx || !low || !comp || !stack || !work || !pos || !internal ||
        !on_stack || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(nodes, i);
        if (!PyList_Check(row) || PyList_GET_SIZE(row) < 3) {
            PyErr_SetString(PyExc_TypeError, "csweep.scc_counts: a node row is not a list");
            goto done;
        }
        PyObject *k = PyLong_FromSsize_t(i);
        if (!k || PyDict_SetItem(index_of, PyList_GET_ITEM(row, 0), k) < 0) {
            Py_XDECREF(k);
            goto done;
        }
        Py_DECREF(k);
        PyObject *kind = PyList_GET_ITEM(row, 2);
        internal[i] = PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "function") == 0;
        idx[i] = -1;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *row = PyList_GET_ITEM(edges, j);
        if (!PyList_Check(row) || PyList_GET_SIZE(row) < 2) {
            PyErr_SetString(PyExc_TypeError, "csweep.scc_counts: an edge row is not a list");
            goto done;
        }
        PyObject *u = PyDict_GetItemWithError(index_of, PyList_GET_ITEM(row, 0));
        PyObject *v = u ? PyDict_GetItemWithError(index_of, PyList_GET_ITEM(row, 1)) : NULL;
        if (!u || !v) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_KeyError, "csweep.scc_counts: an edge of an unknown node");
            goto done;
        }
        eu[j] = PyLong_AsSsize_t(u);
        ev[j] = PyLong_AsSsize_t(v);
        first[eu[j] + 1]++;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        first[i + 1] += first[i];
    memset(pos, 0, sizeof(Py_ssize_t) * (size_t)(n + 1));
    for (Py_ssize_t j = 0; j < m; j++)
        adj[first[eu[j]] + pos[eu[j]]++] = ev[j];
    /* Tarjan: work[] holds the DFS path, pos[] each node's next successor */
    Py_ssize_t counter = 0, sp = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (idx[r] >= 0)
            continue;
        Py_ssize_t wp = 0;
        idx[r] = low[r] = counter++;
        stack[sp++] = r;
        on_stack[r] = 1;
        pos[r] = first[r];
        work[wp++] = r;
        while (wp) {
            Py_ssize_t v = work[wp - 1];
            if (pos[v] < first[v + 1]) {
                Py_ssize_t w = adj[pos[v]++];
                if (idx[w] < 0) {
                    idx[w] = low[w] = counter++;
                    stack[sp++] = w;
                    on_stack[w] = 1;
                    pos[w] = first[w];
                    work[wp++] = w;
                } else if (on_stack[w] && idx[w] < low[v]) {
                    low[v] = idx[w];
                }
                continue;
            }
            wp--;
            if (wp && low[v] < low[work[wp - 1]])
                low[work[wp - 1]] = low[v];
            if (low[v] == idx[v]) {
                Py_ssize_t w;
                do {
                    w = stack[--sp];
                    on_stack[w] = 0;
                    comp[w] = v;
                } while (w != v);
            }
        }
    }
    PyObject *root_index = PyDict_GetItemWithError(index_of, root);
    if (!root_index && PyErr_Occurred())
        goto done;
    Py_ssize_t ri = root_index ? PyLong_AsSsize_t(root_index) : -1;
    Py_ssize_t sccs = 0, complex_sccs = 0, cyclic = 0, calls = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (internal[i] && !seen[comp[i]]) {
            seen[comp[i]] = 1;
            sccs++;
        }
    memset(seen, 0, (size_t)n + 1);
    for (Py_ssize_t j = 0; j < m; j++) {
        if (eu[j] == ri)
            continue;
        calls++;
        if (comp[eu[j]] != comp[ev[j]])
            continue;
        cyclic++;
        if (!seen[comp[eu[j]]]) {
            seen[comp[eu[j]]] = 1;
            complex_sccs++;
        }
    }
    result = Py_BuildValue("(nnnn)", sccs, complex_sccs, cyclic, calls);
done:
    Py_DECREF(index_of);
    PyMem_Free(eu);
    PyMem_Free(ev);
    PyMem_Free(first);
    PyMem_Free(adj);
    PyMem_Free(idx);
    PyMem_Free(low);
    PyMem_Free(comp);
    PyMem_Free(stack);
    PyMem_Free(work);
    PyMem_Free(pos);
    PyMem_Free(internal);
    PyMem_Free(on_stack);
    PyMem_Free(seen);
    return result;
}

/* ------------------------------------------------------------------ fde_ranges (.eh_frame entries)
 * ccprofd.elf.cfi.fde_ranges over the common subset of .eh_frame: 32-bit entries, augmentations of
 * z/R/L/P/S, fixed-size pointer encodings, the CFI opcodes gcc and clang emit.  Anything else (and any
 * read past the section) returns None: the Python walk, the reference, then reads the whole section
 * and says what is wrong.  Why C: that walk was ~0.08 s of python3.11's cold analysis. */
typedef struct {
    const uint8_t *b;
    Py_ssize_t n;
    int bad;
} EhBuf;

static uint64_t eh_uleb(EhBuf *e, Py_ssize_t *pos)
{
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
        if (*pos >= e->n || shift > 56) {
            e->bad = 1;
            return 0;
        }
        uint8_t c = e->b[(*pos)++];
        v |= (uint64_t)(c & 0x7F) << shift;
        shift += 7;
        if (c < 0x80)
            return v;
    }
}

static int64_t eh_sleb(EhBuf *e, Py_ssize_t *pos)
{
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
        if (*pos >= e->n || shift > 56) {
            e->bad = 1;
            return 0;
        }
        uint8_t c = e->b[(*pos)++];
        v |= (uint64_t)(c & 0x7F) << shift;
        shift += 7;
        if (c < 0x80) {
            if (c & 0x40)
                v -= (uint64_t)1 << shift;  /* shift <= 63 */
            return (int64_t)v;
        }
    }
}

static uint64_t eh_fixed(EhBuf *e, Py_ssize_t *pos, int size)
{
    if (*pos < 0 || *pos + size > e->n) {
        e->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    memcpy(&v, e->b + *pos, size);  /* little-endian host (x86-64) */
    *pos += size;
    return v;
}

/* read_encoded: only the fixed-size formats; pc-relative applied when `apply`. */
static uint64_t eh_encoded(EhBuf *e, Py_ssize_t *pos, int enc, uint64_t field_vaddr, int apply)
{
    uint64_t v;
    switch (enc & 0x0F) {
    case 0x00: case 0x04: case 0x0C: v = eh_fixed(e, pos, 8); break;
    case 0x03: v = eh_fixed(e, pos, 4); break;
    case 0x0B: v = (uint64_t)(int64_t)(int32_t)eh_fixed(e, pos, 4); break;
    case 0x02: v = eh_fixed(e, pos, 2); break;
    case 0x0A: v = (uint64_t)(int64_t)(int16_t)eh_fixed(e, pos, 2); break;
    default: e->bad = 1; return 0;
    }
    if (apply && (enc & 0x70) == 0x10)
        v += field_vaddr;
    return v;
}

typedef struct {
    uint64_t reg;
    int64_t off;
    int special;  /* a DW_CFA_def_cfa_expression is in force */
} EhCfa;

/* _execute on the CFA alone, from `pos` to `end`; stop at the first advance when `stop`.  0, or -1
 * for anything the Python interpreter alone handles (e->bad set). */
static int eh_execute(EhBuf *e, Py_ssize_t pos, Py_ssize_t end, EhCfa *st, int fde_enc, int64_t da,
                      int stop)
{
    EhCfa stack[32];
    int depth = 0;
    while (pos < end && !e->bad) {
        if (pos >= e->n) {
            e->bad = 1;
            break;
        }
        uint8_t op = e->b[pos++];
        uint8_t hi = op & 0xC0;
        if (hi == 0x40) {
            if (stop)
                return 0;
            continue;
        }
        if (hi == 0x80) {
            eh_uleb(e, &pos);
            continue;
        }
        if (hi == 0xC0)
            continue;
        __int128 w;
        switch (op) {
        case 0x00: break;
        case 0x02: case 0x03: case 0x04:
            if (stop)
                return 0;
            eh_fixed(e, &pos, op == 0x02 ? 1 : op == 0x03 ? 2 : 4);
            break;
        case 0x01:
            if (stop)
                return 0;
            eh_encoded(e, &pos, fde_enc, 0, 0);
            break;
        case 0x0C:
            st->reg = eh_uleb(e, &pos);
            st->off = (int64_t)eh_uleb(e, &pos);
            st->special = 0;
            break;
        case 0x0D:
            st->reg = eh_uleb(e, &pos);
            st->special = 0;
            break;
        case 0x0E:
            st->off = (int64_t)eh_uleb(e, &pos);
            break;
        case 0x12:
            st->reg = eh_uleb(e, &pos);
            w = (__int128)eh_sleb(e, &pos) * da;
            if (w > INT64_MAX || w < INT64_MIN)
                e->bad = 1;
            st->off = (int64_t)w;
            st->special = 0;
            break;
        case 0x13:
            w = (__int128)eh_sleb(e, &pos) * da;
            if (w > INT64_MAX || w < INT64_MIN)
                e->bad = 1;
            st->off = (int64_t)w;
            break;
        case 0x0F: {
            uint64_t len = eh_uleb(e, &pos);
            if (len > (uint64_t)(e->n - pos))
                e->bad = 1;
            else
                pos += (Py_ssize_t)len;
            st->special = 1;
            break;
        }
        case 0x05: case 0x2F: case 0x09: case 0x14:
            eh_uleb(e, &pos);
            eh_uleb(e, &pos);
            break;
        case 0x11: case 0x15:
            eh_uleb(e, &pos);
            eh_sleb(e, &pos);
            break;
        case 0x06: case 0x07: case 0x08: case 0x2E:
            eh_uleb(e, &pos);
            break;
        case 0x0A:
            if (depth == 32) {
                e->bad = 1;
                break;
            }
            stack[depth++] = *st;
            break;
        case 0x0B:
            if (depth)
                *st = stack[--depth];
            break;
        case 0x10: case 0x16: {
            eh_uleb(e, &pos);
            uint64_t len = eh_uleb(e, &pos);
            if (len > (uint64_t)(e->n - pos))
                e->bad = 1;
            else
                pos += (Py_ssize_t)len;
            break;
        }
        default:
            e->bad = 1;
        }
    }
    return e->bad ? -1 : 0;
}

typedef struct {
    Py_ssize_t off;
    int fde_enc, has_z, signal;
    int64_t da;
    EhCfa init;
} EhCie;

/* parse_cie and the state after its initial instructions; -1: leave it to Python. */
static int eh_cie(EhBuf *e, Py_ssize_t off, EhCie *c)
{
    Py_ssize_t pos = off;
    uint32_t length = (uint32_t)eh_fixed(e, &pos, 4);
    if (e->bad || length == 0xFFFFFFFFu)
        return -1;
    Py_ssize_t end = pos + length;
    pos += 4;  /* CIE id */
    if (pos >= e->n)
        return -1;
    uint8_t version = e->b[pos++];
    const uint8_t *nul = pos < e->n ? memchr(e->b + pos, 0, e->n - pos) : NULL;
    if (nul == NULL)
        return -1;
    const char *aug = (const char *)e->b + pos;
    Py_ssize_t aug_len = (const uint8_t *)nul - (e->b + pos);
    for (Py_ssize_t i = 0; i < aug_len; i++)
        if (strchr("zRLPS", aug[i]) == NULL || aug[i] == 0)
            return -1;  /* "eh", "B", anything else: the Python reader */
    pos += aug_len + 1;
    eh_uleb(e, &pos);
    int64_t da = eh_sleb(e, &pos);
    if (version == 1)
        eh_fixed(e, &pos, 1);
    else
        eh_uleb(e, &pos);
    c->off = off;
    c->da = da;
    c->fde_enc = 0;
    c->has_z = aug_len > 0 && aug[0] == 'z';
    c->signal = memchr(aug, 'S', aug_len) != NULL;
    if (c->has_z) {
        uint64_t alen = eh_uleb(e, &pos);
        if (e->bad || alen > (uint64_t)(e->n - pos))
            return -1;
        Py_ssize_t apos = pos, aend = pos + (Py_ssize_t)alen;
        for (Py_ssize_t i = 1; i < aug_len && !e->bad; i++) {
            if (aug[i] == 'R') {
                c->fde_enc = (int)eh_fixed(e, &apos, 1);
            } else if (aug[i] == 'L') {
                eh_fixed(e, &apos, 1);
            } else if (aug[i] == 'P') {
                int penc = (int)eh_fixed(e, &apos, 1);
                eh_encoded(e, &apos, penc & 0x7F, 0, 0);
            } else if (aug[i] == 'z') {
                return -1;  /* Python stops reading the augmentation there */
            }
        }
        pos = aend;
    }
    if (e->bad)
        return -1;
    c->init.reg = 7;
    c->init.off = 8;
    c->init.special = 0;
    if (end > e->n)  /* Python reads the CIE's instructions up to its end: past the section, it fails */
        return -1;
    return eh_execute(e, pos, end, &c->init, c->fde_enc, da, 0);
}

static PyObject *fde_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view;
    unsigned long long vaddr;
    if (!PyArg_ParseTuple(args, "y*K", &view, &vaddr))
        return NULL;
    EhBuf e = {view.buf, view.len, 0};
    EhCie *cies = NULL;
    Py_ssize_t ncies = 0, cap = 0, last = -1;
    PyObject *out = PyList_New(0);
    Py_ssize_t pos = 0, n = e.n;
    while (out != NULL && pos + 4 <= n) {
        Py_ssize_t p = pos;
        uint32_t length = (uint32_t)eh_fixed(&e, &p, 4);
        if (length == 0xFFFFFFFFu)
            goto fallback;
        if (length == 0)
            break;
        Py_ssize_t body = p, end = p + length;
        if (end > n || body + 4 > n)
            goto fallback;
        uint32_t cie_id = (uint32_t)eh_fixed(&e, &p, 4);
        if (cie_id == 0) {
            pos = end;
            continue;
        }
        Py_ssize_t cie_off = body - (Py_ssize_t)cie_id;
        if (cie_off < 0 || cie_off > n - 8)
            goto fallback;
        EhCie *c = NULL;
        if (last >= 0 && cies[last].off == cie_off) {
            c = &cies[last];
        } else {
            for (Py_ssize_t i = 0; i < ncies; i++)
                if (cies[i].off == cie_off) {
                    c = &cies[i];
                    last = i;
                    break;
                }
        }
        if (c == NULL) {
            if (ncies == cap) {
                cap = cap ? cap * 2 : 16;
                EhCie *grown = PyMem_Realloc(cies, cap * sizeof(EhCie));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    Py_CLEAR(out);
                    break;
                }
                cies = grown;
            }
            if (eh_cie(&e, cie_off, &cies[ncies]) < 0)
                goto fallback;
            last = ncies++;
            c = &cies[last];
        }
        uint64_t pc_begin = eh_encoded(&e, &p, c->fde_enc, (uint64_t)vaddr + (uint64_t)p, 1);
        uint64_t pc_range = eh_encoded(&e, &p, c->fde_enc & 0x0F, 0, 0);
        if (e.bad || (unsigned __int128)pc_begin + pc_range > ((unsigned __int128)1 << 64))
            goto fallback;
        if (c->has_z) {
            uint64_t alen = eh_uleb(&e, &p);
            if (e.bad)
                goto fallback;
            p += (Py_ssize_t)(alen > (uint64_t)n ? (uint64_t)n : alen);
        }
        if (pc_range > 0) {
            EhCfa st = c->init;
            /* malformed instructions: Python keeps the state read so far; we leave it to Python */
            if (eh_execute(&e, p, end, &st, c->fde_enc, c->da, 1) < 0)
                goto fallback;
            int entry = c->signal || (!st.special && st.reg == 7 && st.off == 8);
            PyObject *t = Py_BuildValue("(KKOO)", (unsigned long long)pc_begin,
                                        (unsigned long long)(pc_begin + pc_range),
                                        entry ? Py_True : Py_False, c->signal ? Py_True : Py_False);
            if (t == NULL || PyList_Append(out, t) < 0) {
                Py_XDECREF(t);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(t);
        }
        pos = end;
    }
    PyMem_Free(cies);
    PyBuffer_Release(&view);
    return out;
fallback:
    PyMem_Free(cies);
    PyBuffer_Release(&view);
    Py_XDECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fde_ranges", fde_ranges, METH_VARARGS, "cfi.fde_ranges as (start, end, entry, signal) tuples, or None."},
    {"scan", scan, METH_VARARGS, "sweep()'s loop over capstone's cs_insn records (see disasm.py)."},
    {"sweep", sweep, METH_VARARGS, "scan() over cs_disasm_iter: one reused record (see disasm.py)."},
    {"round_facts", round_facts, METH_VARARGS, "what _sweep_all takes from one round's branches."},
    {"first_non_padding", first_non_padding, METH_VARARGS, "disasm.first_non_padding over cs_disasm_iter."},
    {"table_words", table_words, METH_VARARGS, "analysis._table_words's loop over one slice."},
    {"retype", retype, METH_VARARGS, "lists of tuples copied as another plain tuple type."},
    {"refs_in", refs_in, METH_VARARGS, "analysis._refs_in: sorted references inside regions."},
    {"indirect_jumps", indirect_jumps, METH_VARARGS, "operands of each part's indirect jumps."},
    {"data_refs_of", data_refs_of, METH_VARARGS, "references in a non-executable segment."},
    {"group_edges", group_edges, METH_VARARGS, "one source's edge rows in networkx's order."},
    {"fragment_entries", fragment_entries, METH_VARARGS, "analysis._fold_fragments's jumps into fragments."},
    {"site_counts", site_counts, METH_VARARGS, "stats._stats_of_rows's site counts (see stats.py)."},
    {"scc_counts", scc_counts, METH_VARARGS, "stats._stats_of_rows's component counts (see stats.py)."},
    {"site_rows", site_rows, METH_VARARGS, "analysis._site_row and GraphRows.add_call for every branch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "csweep", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_csweep(void) { return PyModule_Create(&module); }
