"""Property: on byte sequences built from known instructions, the sweep reports every call/jump at a
real instruction boundary, finds exactly the calls that were put there, and decodes their targets.

Instruction encodings and lengths below come from the Intel SDM, not from capstone, so the test is
independent of the disassembler it checks.
"""

from __future__ import annotations

import struct

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ccprofd.callgraph.disasm import Branch, SweepResult, make_disassembler, sweep, sweep_lite

BASE = 0x401000


def _imm32(draw: st.DrawFn) -> bytes:
    return draw(st.binary(min_size=4, max_size=4))


@st.composite
def instruction(draw: st.DrawFn) -> tuple[str, bytes]:
    kind = draw(st.sampled_from([
        "nop", "nop4", "nop5", "mov_imm", "mov_rr", "push", "pop", "call_rel", "call_reg", "call_mem",
        "jmp_rel", "jne8", "lea_rip", "movabs", "endbr", "sub_rsp", "ret", "mov_mem_imm"]))
    enc = {
        "nop": lambda: b"\x90",
        "nop4": lambda: b"\x0f\x1f\x40\x00",
        "nop5": lambda: b"\x0f\x1f\x44\x00\x00",
        "mov_imm": lambda: b"\xb8" + _imm32(draw),           # mov eax, imm32 (imm may hold 0xe8)
        "mov_rr": lambda: b"\x48\x89\xd8",                  # mov rax, rbx
        "push": lambda: b"\x55",
        "pop": lambda: b"\x5d",
        "call_rel": lambda: b"\xe8" + _imm32(draw),
        "call_reg": lambda: b"\xff\xd0",                    # call rax
        "call_mem": lambda: b"\xff\x15" + _imm32(draw),     # call qword ptr [rip + d]
        "jmp_rel": lambda: b"\xe9" + _imm32(draw),
        "jne8": lambda: b"\x75" + draw(st.binary(min_size=1, max_size=1)),
        "lea_rip": lambda: b"\x48\x8d\x3d" + _imm32(draw),  # lea rdi, [rip + d]
        "movabs": lambda: b"\x48\xb8" + draw(st.binary(min_size=8, max_size=8)),
        "endbr": lambda: b"\xf3\x0f\x1e\xfa",
        "sub_rsp": lambda: b"\x48\x83\xec" + draw(st.binary(min_size=1, max_size=1)),
        "ret": lambda: b"\xc3",
        "mov_mem_imm": lambda: b"\xc7\x45\xfc" + _imm32(draw),  # mov dword ptr [rbp-4], imm32
    }[kind]()
    return kind, enc


@settings(max_examples=300, deadline=None)
@given(st.lists(instruction(), min_size=1, max_size=60))
def test_sites_on_boundaries(program: list[tuple[str, bytes]]) -> None:
    code = b"".join(enc for _, enc in program)
    boundaries: dict[int, tuple[str, bytes]] = {}
    addr = BASE
    for kind, enc in program:
        boundaries[addr] = (kind, enc)
        addr += len(enc)
    result = SweepResult([], [], 0)
    sweep(make_disassembler(), code, BASE, result)

    assert result.instructions == len(program)
    for b in result.branches:
        assert b.address in boundaries, hex(b.address)
        kind, enc = boundaries[b.address]
        assert b.length == len(enc) and b.raw == enc
    expected_calls = {a: enc for a, (k, enc) in boundaries.items() if k == "call_rel"}
    found_calls = {b.address: b for b in result.branches if b.is_call and b.target is not None}
    assert set(found_calls) == set(expected_calls)
    for a, enc in expected_calls.items():
        rel = struct.unpack("<i", enc[1:])[0]
        assert found_calls[a].target == (a + 5 + rel) & 0xFFFFFFFFFFFFFFFF
    indirect_calls = {b.address for b in result.branches if b.is_call and b.target is None}
    assert indirect_calls == {a for a, (k, _) in boundaries.items() if k in ("call_reg", "call_mem")}
    jumps = {b.address for b in result.branches if not b.is_call}
    assert jumps == {a for a, (k, _) in boundaries.items() if k in ("jmp_rel", "jne8")}
    leas = [a for a, (k, _) in boundaries.items() if k == "lea_rip"]
    for a in leas:
        enc = boundaries[a][1]
        assert a + 7 + struct.unpack("<i", enc[3:])[0] in result.code_refs


def _local(b: Branch, base: int, end: int) -> bool:
    return not b.is_call and b.target is not None and base <= b.target < end


#: Prefixes capstone prints as part of the mnemonic ("bnd jmp", "notrack call", "rep ...") and
#: encodings the record reader treats apart (rel8/rel32 jumps, 66-prefixed and far branches, mov forms).
_BRANCHY = [b"\xf2", b"\x3e", b"\xf3", b"\x66", b"\x48", b"\xe8", b"\xe9", b"\xeb", b"\x74", b"\x0f\x84",
            b"\xe3", b"\xff\x15", b"\xff\x25", b"\xff\xe0", b"\xff\x1d", b"\x48\xb8", b"\xc7\x05",
            b"\x48\x8d\x05", b"\x68", b"\x89\xc0", b"\x48\x8b\x05", b"\xc3", b"\x90", b"\x0f\x05"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_BRANCHY), st.binary(min_size=1, max_size=6)), max_size=80))
@example([b"\x90" * 4, b"\xeb\xf0", b"\x90" * 300])  # a short jump back out of the code: not local
@example([b"\x90" * 4, b"\x0f\x84" + struct.pack("<i", -20), b"\x90" * 300])
def test_record_reader_matches_disasm_lite(pieces: list[bytes]) -> None:
    """The sweep reads capstone's instruction records directly and decodes the text of a few of them;
    on any bytes it must report exactly what the plain ``disasm_lite`` loop (sweep_lite) reports, and
    with ``local_jumps=False`` the same minus the direct jumps that land inside the swept bytes."""
    code = b"".join(pieces)
    md = make_disassembler()
    ref = SweepResult([], [], 0)
    sweep_lite(md, code, BASE, ref)
    fast = SweepResult([], [], 0)
    sweep(md, code, BASE, fast)
    assert fast == ref
    nolocal = SweepResult([], [], 0)
    sweep(md, code, BASE, nolocal, local_jumps=False)
    end = BASE + len(code)
    assert nolocal.branches == [b for b in ref.branches if not _local(b, BASE, end)]
    assert (nolocal.code_refs, nolocal.instructions) == (ref.code_refs, ref.instructions)


def test_record_reader_on_a_system_binary() -> None:
    """The same agreement over every byte of the code sections of /usr/bin/bash (a real mix of
    compiler output, padding and jump tables), swept in 64 KiB pieces."""
    from ccprofd.elf.image import ElfImage

    image = ElfImage("/usr/bin/bash")
    md = make_disassembler()
    for sec in image.code_sections():
        body = image.section_bytes(sec)
        for off in range(0, len(body), 1 << 16):
            ref = SweepResult([], [], 0)
            sweep_lite(md, body[off:off + (1 << 16)], sec.vaddr + off, ref)
            fast = SweepResult([], [], 0)
            sweep(md, body[off:off + (1 << 16)], sec.vaddr + off, fast)
            assert fast == ref, hex(sec.vaddr + off)
