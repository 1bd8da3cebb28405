"""libcapstone's x86-64 disassembler without the capstone package's Python bindings.

``import capstone`` executes the bindings and constants of every architecture capstone knows (~30
modules, 0.1-0.2 s: a tenth of a cold ``analyze``), for the handful of calls ccprofd makes.  This
module loads the same libcapstone.so (the one the package ships, found without importing it) with
ctypes and offers what the call graph uses: a handle (``csh``, for csweep.c), ``insn_name`` and
``disasm_lite``, and capstone's ``cs_insn`` layout.  If that library cannot be found or is not the
version this layout is written for, :func:`x86_64` returns ``capstone.Cs`` itself (same methods).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Iterator
from functools import cache
from typing import Any

_CS_ARCH_X86 = 3
_CS_MODE_64 = 1 << 3
_CS_OPT_SKIPDATA = 5
_CS_OPT_ON = 3
_VERSION = (5, 0)  # the cs_insn layout below is capstone 5's


class CsInsn(ctypes.Structure):
    """capstone 5's ``cs_insn`` (capstone.h); tests/test_elf_x86dis.py checks it against the binding's."""

    _fields_ = (
        ("id", ctypes.c_uint),
        ("address", ctypes.c_uint64),
        ("size", ctypes.c_uint16),
        ("bytes", ctypes.c_ubyte * 24),
        ("mnemonic", ctypes.c_char * 32),
        ("op_str", ctypes.c_char * 160),
        ("detail", ctypes.c_void_p),
    )


@cache
def library() -> ctypes.CDLL | None:
    """The capstone package's libcapstone.so, loaded alone (None: not found, or another version)."""
    spec = importlib.util.find_spec("capstone")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        path = os.path.join(where, "lib", "libcapstone.so")
        if os.path.exists(path):
            break
    else:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.cs_version.restype = ctypes.c_int
    lib.cs_version(ctypes.byref(major), ctypes.byref(minor))
    if (major.value, minor.value) != _VERSION:
        return None
    lib.cs_open.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(ctypes.c_size_t))
    lib.cs_option.argtypes = (ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t)
    lib.cs_insn_name.restype = ctypes.c_char_p
    lib.cs_insn_name.argtypes = (ctypes.c_size_t, ctypes.c_uint)
    lib.cs_disasm.restype = ctypes.c_size_t
    lib.cs_disasm.argtypes = (ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64,
                              ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(CsInsn)))
    lib.cs_free.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.cs_errno.argtypes = (ctypes.c_size_t,)
    lib.cs_close.argtypes = (ctypes.POINTER(ctypes.c_size_t),)
    return lib


class X86_64:
    """A capstone handle for x86-64 (the subset of ``capstone.Cs`` ccprofd uses)."""

    def __init__(self, lib: ctypes.CDLL, skipdata: bool) -> None:
        self._lib = lib
        self.csh = ctypes.c_size_t()
        status = lib.cs_open(_CS_ARCH_X86, _CS_MODE_64, ctypes.byref(self.csh))
        if status == 0 and skipdata:
            status = lib.cs_option(self.csh, _CS_OPT_SKIPDATA, _CS_OPT_ON)
        if status != 0:
            raise OSError(f"capstone: cs_open/cs_option failed ({status})")

    def __del__(self) -> None:
        if self.csh.value:
            self._lib.cs_close(ctypes.byref(self.csh))

    def insn_name(self, insn_id: int) -> str | None:
        name = self._lib.cs_insn_name(self.csh, insn_id)
        return name.decode("ascii") if name else None

    def disasm_lite(self, code: bytes, offset: int) -> Iterator[tuple[int, int, str, str]]:
        """(address, size, mnemonic, operands) of each instruction, as capstone.Cs.disasm_lite."""
        insns = ctypes.POINTER(CsInsn)()
        n = self._lib.cs_disasm(self.csh, code, len(code), offset, 0, ctypes.byref(insns))
        if n <= 0:
            status = self._lib.cs_errno(self.csh)
            if status != 0:
                raise OSError(f"capstone: cs_disasm failed ({status})")
            return
        try:
            for i in range(n):
                insn = insns[i]
                yield insn.address, insn.size, insn.mnemonic.decode("ascii"), insn.op_str.decode("ascii")
        finally:
            self._lib.cs_free(insns, n)


def x86_64(skipdata: bool = False) -> Any:
    """An x86-64 disassembler: :class:`X86_64` over libcapstone, else ``capstone.Cs``."""
    lib = library()
    if lib is not None:
        return X86_64(lib, skipdata)
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    md = Cs(CS_ARCH_X86, CS_MODE_64)
    md.skipdata = skipdata
    return md


def entry_points() -> tuple[int, int, int]:
    """Addresses of cs_disasm_iter, cs_malloc and cs_free (csweep.c calls them)."""
    lib: Any = library()
    if lib is None:
        import capstone

        lib = capstone._cs
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0  # type: ignore[return-value]
                 for name in ("cs_disasm_iter", "cs_malloc", "cs_free"))
