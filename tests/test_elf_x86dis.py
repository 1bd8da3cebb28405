"""ccprofd/elf/x86dis.py (libcapstone loaded without the capstone package) against the capstone
package's own binding: the same cs_insn layout, instruction names and ids, and the same
disassembly of real code; and a cold analysis no longer imports the package."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import capstone
import pytest
from capstone.x86_const import X86_INS_CALL, X86_INS_ENDING, X86_INS_JMP

from ccprofd.callgraph import disasm
from ccprofd.elf import x86dis
from ccprofd.elf.image import ElfImage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_library_is_found_without_the_package() -> None:
    assert x86dis.library() is not None
    assert isinstance(x86dis.x86_64(), x86dis.X86_64)


def test_cs_insn_layout_equals_the_bindings() -> None:
    ours, theirs = x86dis.CsInsn, capstone._cs_insn
    assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
    for name, _ in theirs._fields_:
        assert (getattr(ours, name).offset, getattr(ours, name).size) == (
            getattr(theirs, name).offset, getattr(theirs, name).size), name


def test_instruction_ids_and_names_equal_the_bindings() -> None:
    assert disasm._insn_ids() == (X86_INS_CALL, X86_INS_JMP, X86_INS_ENDING)
    md, cs = x86dis.x86_64(), capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    assert [md.insn_name(i) for i in range(1, X86_INS_ENDING)] == [cs.insn_name(i) for i in
                                                                   range(1, X86_INS_ENDING)]


@pytest.mark.parametrize("path", ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"])
@pytest.mark.parametrize("skipdata", [False, True])
def test_disasm_lite_equals_the_bindings(path: str, skipdata: bool) -> None:
    image = ElfImage(path)
    sec = next(s for s in image.code_sections() if s.name == ".text")
    code = image.bytes_at(sec.vaddr, min(sec.size, 1 << 17))
    md = x86dis.x86_64(skipdata=skipdata)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.skipdata = skipdata
    ours = list(md.disasm_lite(code, sec.vaddr))
    assert len(ours) > 10_000
    assert ours == list(cs.disasm_lite(code, sec.vaddr))
    plt = list(md.disasm_lite(b"\xff\x25\x02\x00\x00\x00\x06", 0x1000))  # jmp [rip+2]; a bad byte
    assert plt[0] == (0x1000, 6, "jmp", "qword ptr [rip + 2]")
    assert len(plt) == (2 if skipdata else 1)


def test_a_cold_analysis_does_not_import_the_capstone_package(tmp_path: object) -> None:
    code = ("import sys\nfrom ccprofd.callgraph import analyze_binary\n"
            "analyze_binary('/usr/bin/bash', use_cache=False)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'capstone'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert out.strip() == "[]"


def test_without_the_library_the_package_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libcapstone cannot be loaded alone, capstone.Cs does the same work, and the compiled
    sweep gets the package's entry points."""
    monkeypatch.setattr(x86dis, "library", lambda: None)
    md = x86dis.x86_64(skipdata=True)
    assert isinstance(md, capstone.Cs) and md.skipdata
    assert list(md.disasm_lite(b"\xe8\x00\x00\x00\x00", 0x10)) == [(0x10, 5, "call", "0x15")]
    assert x86dis.entry_points() == tuple(ctypes.cast(getattr(capstone._cs, n), ctypes.c_void_p).value
                                          for n in ("cs_disasm_iter", "cs_malloc", "cs_free"))
