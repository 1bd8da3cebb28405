"""Integer constants of a BPF C source, read from its ``#define`` lines.

A constant that the BPF program and its Python loader must agree on (record kinds, flag bits, map
indexes) is written once, in the C file; the Python side takes it from here instead of keeping a
hand copy.  Values that Python computes and passes *into* the program (sizes, limits) go the other
way, through the ``#define`` prelude the loaders generate, and are not read here.

Only object-like macros whose body is an integer constant expression are kept (decimal, hex or
octal literals with C integer suffixes, earlier such macros, parentheses and the operators
``~ - + * / % << >> & | ^``); anything else (function-like macros, strings, casts) is skipped.  The
first definition of a name wins, as with an ``#ifndef NAME`` default; tests/test_bpf_constants.py
checks every value Python uses against gcc's own preprocessing and evaluation of the same file.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from collections.abc import Callable
from pathlib import Path

_DEFINE = re.compile(r"^\s*#\s*define\s+([A-Za-z_]\w*)(?!\()\s+(.*?)\s*$")
_COMMENT = re.compile(r"/\*.*?\*/|//.*$")
_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")  # 64ULL -> 64
_OCTAL = re.compile(r"\b0(\d+)\b")  # C 017 -> Python 0o17
_BIN: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
    ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
}
_UNARY: dict[type, Callable[[int], int]] = {ast.USub: operator.neg, ast.UAdd: operator.pos,
                                            ast.Invert: operator.invert}


class _NotConstant(Exception):
    pass


def _evaluate(expr: str, known: dict[str, int]) -> int:
    text = _OCTAL.sub(r"0o\1", _SUFFIX.sub(r"\1", expr)).replace("/", "//")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise _NotConstant from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            return _BIN[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise _NotConstant

    return ev(tree.body)


def parse_defines(text: str) -> dict[str, int]:
    """NAME -> value of every integer constant ``#define`` in C source ``text`` (first one wins)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _DEFINE.match(_COMMENT.sub("", line))
        if m is None or m.group(1) in out or not m.group(2):
            continue
        try:
            out[m.group(1)] = _evaluate(m.group(2), out)
        except (_NotConstant, ZeroDivisionError, ValueError):
            continue
    return out


@functools.cache
def c_constants(source: Path) -> dict[str, int]:
    """The integer constants of the C file ``source`` (read once per process)."""
    return parse_defines(source.read_text(encoding="utf-8"))
