"""Go's function table (ccprofd/elf/gopclntab.py) and the unwind rows made from it (cfi.go_fdes).

Oracles, all independent of ccprofd: the Go linker's own ``.debug_frame`` (generated from the same
``pcsp`` tables) as ``readelf -wF`` interprets it, row by row; ``nm``'s symbols of the unstripped
binary for the functions' names and entries; and ``strip``, which must not change the rows (the
reason to read ``.gopclntab``: Debian strips its Go binaries, ``.debug_frame`` included)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest
from binutils_oracle import nm_defined_sizes
from conftest import require_tool, skip_or_fail
from test_cfi_readelf import readelf_frames
from test_unwind_go import build_go

from ccprofd.elf import cfi
from ccprofd.elf.gopclntab import (
    FUNC_FLAG_SPWRITE,
    FUNC_FLAG_TOPFRAME,
    SECTIONS,
    GoTableError,
    parse_go_functions,
    read_go_functions,
)
from ccprofd.elf.image import ElfImage


@pytest.fixture(scope="module", params=["exe", "pie"])
def go_binaries(tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> tuple[pathlib.Path, pathlib.Path]:
    """gocalls as built (with DWARF) and its ``strip``ped copy (same addresses); as an executable
    and as ``-buildmode=pie`` (the table in ``.data.rel.ro.gopclntab``, its text start relocated)."""
    d = tmp_path_factory.mktemp("go")
    full = build_go(d, pie=request.param == "pie")
    stripped = d / "gocalls.stripped"
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    return full, stripped


def test_rows_are_the_go_linkers_debug_frame(go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    require_tool("readelf")
    full, _ = go_binaries
    image = ElfImage(str(full))
    table = cfi.build_table(image)
    assert table.sources[0] == ".gopclntab"
    fdes = [f for f in readelf_frames(str(full)) if f.section == ".debug_frame"]
    assert len(fdes) > 1000
    special = {f.entry for f in read_go_functions(image) if f.flag & (FUNC_FLAG_TOPFRAME | FUNC_FLAG_SPWRITE)
               or image.bytes_at(f.entry, len(cfi.SIGRETURN_CODE)) == cfi.SIGRETURN_CODE}
    checked = 0
    for fde in fdes:
        if fde.lo in special:
            continue  # their rows are the chain's end, a stack switch or a signal frame by design (below)
        for i, (loc, row) in enumerate(fde.rows):
            end = fde.rows[i + 1][0] if i + 1 < len(fde.rows) else fde.hi
            if end <= loc:
                continue  # readelf prints a row the next one replaces at the same address
            for pc in (loc, end - 1):
                rule = table.lookup(pc)
                assert (cfi.KIND_NAMES[rule.kind], rule.cfa_off, rule.ra_off) == \
                    ("rsp", int(row["CFA"].removeprefix("rsp+")), int(row["ra"].removeprefix("c"))), \
                    (hex(pc), row, rule.describe())
                checked += 1
    assert checked > 5000


def test_stripping_keeps_every_row(go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    full, stripped = go_binaries
    a, b = ElfImage(str(full)), ElfImage(str(stripped))
    assert ".debug_frame" not in b.sections and ".symtab" not in b.sections
    ta, tb = cfi.build_table(a), cfi.build_table(b)
    assert tb.sources == (".gopclntab",)
    go = [(f.entry, f.end) for f in read_go_functions(b)]
    assert go == [(f.entry, f.end) for f in read_go_functions(a)]
    for lo, hi in go:
        for pc in range(lo, hi):
            assert ta.lookup(pc) == tb.lookup(pc), hex(pc)


def test_names_and_entries_are_nms(go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    full, stripped = go_binaries
    nm = subprocess.run(["nm", str(full)], capture_output=True, text=True, check=True).stdout
    at: dict[int, set[str]] = {}
    for line in nm.splitlines():
        parts = line.split(maxsplit=2)  # (names may hold spaces: "type..eq.struct { ... }")
        if len(parts) == 3 and parts[1] in "Tt":
            at.setdefault(int(parts[0], 16), set()).add(parts[2])
    funcs = read_go_functions(ElfImage(str(stripped)))
    assert {"main.main", "main.mid", "main.leaf", "runtime.goexit"} <= {f.name for f in funcs}
    for f in funcs:
        names = at.get(f.entry, set())
        # the linker's symbols add ".abi0" to assembly functions; Go's table writes array lengths
        # in type names as "[...]"
        pattern = re.compile(re.escape(f.name).replace(r"\[\.\.\.\]", r"\[\d+\]") + r"(\.abi0)?")
        assert any(pattern.fullmatch(n) for n in names), (f.name, hex(f.entry), names)
    tops = {f.name for f in funcs if f.flag & FUNC_FLAG_TOPFRAME}
    assert {"runtime.goexit", "runtime.mstart", "runtime.rt0_go"} <= tops  # runtime/symtab.go's list


def test_stack_switches_stop_at_their_return_addresses(
        go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    """``runtime.systemstack`` loads rsp with the system stack, calls its function there and loads
    the goroutine's rsp back (objdump, Intel syntax: ``mov rsp,...`` twice): the code between, and
    the switch back itself (until it has run, rsp is g0's), is a stop at every byte, and so is each
    call's last byte (where a return address is looked up); the switch onto g0 (not run yet) and
    the code after the switch back, its ``ret``, keep pcsp's row."""
    require_tool("objdump")
    full, _ = go_binaries
    image = ElfImage(str(full))
    fn = next(f for f in read_go_functions(image) if f.name == "runtime.systemstack")
    assert fn.flag & FUNC_FLAG_SPWRITE
    dis = objdump_function(full, fn.entry, fn.end)
    insns = [(int(m.group(1), 16), [*m.group(2).split(None, 1), ""])
             for m in re.finditer(r"^\s+([0-9a-f]+):\t(.*)$", dis, re.M)]
    switches = [a for a, words in insns if words[0] == "mov" and words[1].startswith("rsp,")]
    assert len(switches) == 2, insns  # onto the system stack, and back
    table = cfi.build_table(image)
    crossing = systemstack_crossing(full, dis)
    for (a, words), nxt in zip(insns, [*insns[1:], (fn.end, [])], strict=True):
        ra = nxt[0]
        if words[0] == "call" and switches[0] < a < switches[1]:
            assert table.lookup(ra - 1) == crossing, hex(a)  # the call on g0 (test_unwind_go crosses it)
        elif words[0] == "call":
            assert table.lookup(ra - 1) == cfi.STACK_SWITCH, hex(a)
        if switches[0] < a <= switches[1] and not (words[0] == "call" or a == ra - 1):
            assert table.lookup(a) == cfi.STACK_SWITCH, hex(a)
        elif a <= switches[0] or a > switches[1]:
            assert table.lookup(a).kind == cfi.CFA_RSP, hex(a)
    assert any(w[0] == "ret" and a > switches[1] for a, w in insns)
    top = next(f for f in read_go_functions(image) if f.name == "runtime.goexit")
    assert table.lookup(top.entry + 1).kind == cfi.END


def systemstack_crossing(binary: pathlib.Path, dis: str) -> cfi.Rule:
    """The GO_SWITCH row systemstack's call on g0 must have, from objdump's reading of its code (Intel
    syntax): g's TLS slot (``mov rax,QWORD PTR fs:...``), ``g.m`` (``mov rbx,QWORD PTR [rax+...]``),
    ``m.curg`` (the compare before the call of gosave), ``g.sched.sp`` (the load rsp is set from),
    and the pc gosave stores: ``runtime.systemstack_switch``'s address (nm)."""
    tls = re.search(r"mov\s+(\w+),QWORD PTR fs:(?:(0x[0-9a-f]+)|\[(\w+)\])", dis)
    assert tls, dis
    if tls.group(2):
        tls_off = int(tls.group(2), 16) - (1 << 64)
    else:  # -buildmode=pie: mov rcx,0xfffffffffffffff8; mov rax,QWORD PTR fs:[rcx]
        value = re.search(rf"mov\s+{tls.group(3)},(0x[0-9a-f]+)\n", dis)
        assert value, dis
        tls_off = int(value.group(1), 16) - (1 << 64)
    g_m = re.search(rf"mov\s+(\w+),QWORD PTR \[{tls.group(1)}\+(0x[0-9a-f]+)\]", dis)
    assert g_m, dis
    before_call = dis.split("\tcall ", 1)[0]
    curg = re.findall(rf"cmp\s+{tls.group(1)},QWORD PTR \[{g_m.group(1)}\+(0x[0-9a-f]+)\]", before_call)
    sched = re.search(r"mov\s+(\w+),QWORD PTR \[\w+\+(0x[0-9a-f]+)\]\n.*mov\s+rsp,(\w+)", dis)
    assert curg and sched and sched.group(1) == sched.group(3), dis
    switch_pc = next(a for n, (a, _) in nm_defined_sizes(binary).items()
                     if n.removesuffix(".abi0") == "runtime.systemstack_switch")
    return cfi.Rule(cfi.GO_SWITCH, tls_off, int(sched.group(2), 16), int(curg[-1], 16), switch_pc,
                    int(g_m.group(2), 16))


def test_sigreturn_is_a_signal_frame_as_glibcs_and_async_preempt_returns_exactly(
        go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Go's runtime.sigreturn is written to be byte for byte glibc's __restore_rt (``mov $15, %rax;
    syscall``: gdb and libgcc recognise signal frames by it), so its row is what glibc's own CFI says
    for __restore_rt (libc's table, at the address of libc6-dbg's symbol): the ucontext at rsp.  And
    asyncPreempt, which Go's signal handler injects as if the interrupted function had called it,
    returns to the interrupted instruction itself: its rows say the caller's pc is exact."""
    full, _ = go_binaries
    image = ElfImage(str(full))
    table = cfi.build_table(image)
    funcs = {f.name: f for f in read_go_functions(image)}
    sigreturn = funcs["runtime.sigreturn"]
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    bid = ElfImage(libc).build_id()
    debug = pathlib.Path(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug")
    if not debug.exists():
        skip_or_fail("libc6-dbg's debug file for this libc is not installed")
    restore_rt = nm_defined_sizes(debug)["__restore_rt"][0]
    glibc = cfi.load_table(libc).lookup(restore_rt)
    assert glibc.kind == cfi.SIGNAL
    for pc in range(sigreturn.entry, sigreturn.end):
        assert table.lookup(pc) == glibc, hex(pc)
    preempt = funcs["runtime.asyncPreempt"]
    rows = {table.lookup(pc) for pc in range(preempt.entry, preempt.end)}
    assert rows and all(r.kind == cfi.CFA_RSP and r.aux == cfi.CALLER_EXACT for r in rows), rows


def test_systemstack_reader_refuses_code_of_another_shape(
        go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    """ccprofd/elf/gostack.py reads the offsets from systemstack's own instructions; code of another
    shape (here: its way back, which loads rsp from m.curg.sched.sp too, taken away) gives no
    crossing, so the switch stays flagged rather than crossed on a guess."""
    from ccprofd.elf.gostack import _parse_systemstack, read_systemstack
    from ccprofd.elf.x86dis import x86_64

    full, _ = go_binaries
    image = ElfImage(str(full))
    funcs = read_go_functions(image)
    by_name, by_entry = {f.name: f for f in funcs}, {f.entry: f for f in funcs}
    assert read_systemstack(image, by_name, by_entry) is not None
    fn = by_name["runtime.systemstack"]
    insns = list(x86_64().disasm_lite(image.bytes_at(fn.entry, fn.end - fn.entry), fn.entry))
    assert _parse_systemstack(insns) is not None
    back = max(i for i, (_, _, mnem, ops) in enumerate(insns) if mnem == "mov" and ops.startswith("rsp,"))
    assert _parse_systemstack(insns[:back] + insns[back + 1:]) is None
    assert read_systemstack(image, {}, by_entry) is None  # no systemstack at all


def objdump_function(binary: pathlib.Path, entry: int, end: int) -> str:
    return subprocess.run(["objdump", "-d", "-M", "intel", "--no-show-raw-insn",
                           f"--start-address={entry:#x}", f"--stop-address={end:#x}", str(binary)],
                          capture_output=True, text=True, check=True).stdout


def test_morestack_row_is_objdumps_reading(go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    """morestack's call of newstack on g0 (objdump: the call right after ``mov rsp,QWORD PTR
    [reg+sched.sp]``) is GO_MORESTACK at its last byte, with systemstack's offsets (objdump's
    reading, :func:`systemstack_crossing`) and the entries of morestack and morestack_noctxt (nm);
    every call of either in the binary has the plain pcsp row CFA = rsp + 8 at its last byte (where
    a goroutine's frame at its ``sched.pc`` is looked up); and Go's execute and schedule, and no
    other function, have rows flagged GO_CURG_SET."""
    require_tool("objdump")
    full, _ = go_binaries
    image = ElfImage(str(full))
    funcs = {f.name: f for f in read_go_functions(image)}
    entry = {n.removesuffix(".abi0"): a for n, (a, _) in nm_defined_sizes(full).items()}
    ss = funcs["runtime.systemstack"]
    crossing = systemstack_crossing(full, objdump_function(full, ss.entry, ss.end))
    ms = funcs["runtime.morestack"]
    dis = objdump_function(full, ms.entry, ms.end)
    got = re.search(r"mov\s+rsp,QWORD PTR \[\w+\+(0x[0-9a-f]+)\]\n\s+[0-9a-f]+:\s+call\s+[0-9a-f]+ "
                    r"<runtime\.newstack[^>]*>\n\s+([0-9a-f]+):", dis)
    assert got and int(got.group(1), 16) == crossing.rbp_kind, dis
    table = cfi.build_table(image)
    expect = cfi.Rule(cfi.GO_MORESTACK, crossing.cfa_off, crossing.rbp_kind, entry["runtime.morestack"],
                      entry["runtime.morestack_noctxt"], crossing.aux | crossing.rbp_off << 8)
    assert table.lookup(int(got.group(2), 16) - 1) == expect
    text = subprocess.run(["objdump", "-d", "-M", "intel", "--no-show-raw-insn", str(full)],
                          capture_output=True, text=True, check=True).stdout
    calls = re.findall(r"call\s+[0-9a-f]+ <runtime\.morestack(?:_noctxt)?(?:\.abi0)?>\n\s+([0-9a-f]+):", text)
    assert len(calls) > 100
    # (execute's and schedule's own calls carry their functions' flag)
    rows = {table.lookup(int(a, 16) - 1) for a in calls}
    assert {r._replace(aux=r.aux & ~cfi.GO_CURG_SET) for r in rows} == {cfi.Rule(cfi.CFA_RSP, 8)}
    flagged = {name for name, f in funcs.items()
               if any(table.lookup(pc).aux & cfi.GO_CURG_SET for pc in range(f.entry, f.end)
                      if table.lookup(pc).kind == cfi.CFA_RSP)}
    assert flagged == {"runtime.execute", "runtime.schedule"}


def test_morestack_reader_refuses_code_of_another_shape(
        go_binaries: tuple[pathlib.Path, pathlib.Path]) -> None:
    """morestack's store of the calling function's pc in ``g.sched.pc`` taken away, or its call on
    g0 made indirect: no crossing (the switch stays flagged)."""
    from ccprofd.elf.gostack import _parse_morestack, read_morestack, read_systemstack
    from ccprofd.elf.x86dis import x86_64

    full, _ = go_binaries
    image = ElfImage(str(full))
    funcs = read_go_functions(image)
    by_name, by_entry = {f.name: f for f in funcs}, {f.entry: f for f in funcs}
    switch = read_systemstack(image, by_name, by_entry)
    assert switch is not None and read_morestack(image, by_name, switch) is not None
    fn = by_name["runtime.morestack"]
    insns = list(x86_64().disasm_lite(image.bytes_at(fn.entry, fn.end - fn.entry), fn.entry))
    assert _parse_morestack(insns, switch) is not None
    pc_slot = f"+ {hex(switch.sched_sp + 8)}]"
    pc_store = [i for i, (_, _, mnem, ops) in enumerate(insns)
                if mnem == "mov" and ops.startswith("qword ptr [") and pc_slot in ops]
    assert len(pc_store) == 1, insns
    assert _parse_morestack(insns[:pc_store[0]] + insns[pc_store[0] + 1:], switch) is None
    call = next(i for i, (_, _, mnem, _) in enumerate(insns) if mnem == "call" and i > pc_store[0])
    indirect = (*insns[call][:3], "rax")
    assert _parse_morestack([*insns[:call], indirect, *insns[call + 1:]], switch) is None
    assert read_morestack(image, {}, switch) is None


def test_vdso_call_rows_are_objdumps_reading(tmp_path: pathlib.Path) -> None:
    """Go's time.now (gotime.go; objdump, Intel syntax): ``lea D,[rsp+0x20]; mov C,QWORD PTR
    [D-0x8]`` (its return address), stored in ``m.vdsoPC`` and, D, in ``m.vdsoSP``; from the next
    instruction to ``mov rsp,r12`` (included: until it has run, rsp is g0's) and in the syscall
    fallback (from the ``je`` target to its ``jmp`` back), every byte is GO_VDSO with those offsets
    and systemstack's TLS slot and g.m; before the stores and after the move back, pcsp's rows."""
    from test_unwind_go import TIME_SOURCE

    require_tool("objdump")
    binary = build_go(tmp_path, source=TIME_SOURCE)
    image = ElfImage(str(binary))
    funcs = {f.name: f for f in read_go_functions(image)}
    ss = funcs["runtime.systemstack"]
    crossing = systemstack_crossing(binary, objdump_function(binary, ss.entry, ss.end))
    fn = funcs["time.now"]
    dis = objdump_function(binary, fn.entry, fn.end)
    insns = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+([0-9a-f]+):\t(.*)$", dis, re.M)]
    text = "\n".join(t for _, t in insns)
    got = re.search(r"lea\s+(\w+),\[rsp\+0x20\]\nmov\s+(\w+),QWORD PTR \[\1-0x8\]\n"
                    r"mov\s+QWORD PTR \[\w+\+(0x[0-9a-f]+)\],\2\n"
                    r"mov\s+QWORD PTR \[\w+\+(0x[0-9a-f]+)\],\1\n", text)
    assert got, dis
    expect = cfi.Rule(cfi.GO_VDSO, crossing.cfa_off, cfi.RBP_UNDEF, int(got.group(4), 16),
                      int(got.group(3), 16), crossing.aux)
    lines = [t for _, t in insns]
    first = lines.index(got.group(0).split("\n")[3]) + 1
    back = next(i for i, t in enumerate(lines) if re.fullmatch(r"mov\s+rsp,r12", t))
    je = next(t for t in lines[first:back] if t.startswith("je "))
    fallback = next(i for i, (a, _) in enumerate(insns) if a == int(je.split()[1], 16))
    jmp_back = next(i for i in range(fallback, len(insns)) if lines[i].startswith("jmp "))
    region = set(range(first, back + 1)) | set(range(fallback, jmp_back + 1))
    table = cfi.build_table(image)
    ends = [a for a, _ in insns[1:]] + [fn.end]
    for i, (a, t) in enumerate(insns):
        if t.startswith("int3"):
            continue
        rows = {table.lookup(pc) for pc in range(a, ends[i])}
        if i in region:
            assert rows == {expect}, (hex(a), t, rows)
        elif i < first or back < i < fallback:
            assert all(r.kind == cfi.CFA_RSP for r in rows), (hex(a), t, rows)


def test_bad_tables_are_refused_not_guessed(tmp_path: pathlib.Path) -> None:
    with pytest.raises(GoTableError, match="magic"):
        parse_go_functions(b"\xfa\xff\xff\xff" + bytes(80))  # Go 1.16's layout
    with pytest.raises(GoTableError):
        parse_go_functions(b"\xf0\xff\xff\xff")
    true = shutil.which("true") or "/bin/true"
    assert read_go_functions(ElfImage(true)) == []  # not Go


def test_a_corrupt_gopclntab_leaves_go_code_without_rows(go_binaries: tuple[pathlib.Path, pathlib.Path],
                                                        tmp_path: pathlib.Path) -> None:
    _, stripped = go_binaries
    image = ElfImage(str(stripped))
    sec = next(image.sections[n] for n in SECTIONS if n in image.sections)
    data = bytearray(stripped.read_bytes())
    data[sec.offset:sec.offset + 4] = b"\x00\x00\x00\x00"
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(data))
    table = cfi.build_table(ElfImage(str(bad)))
    assert ".gopclntab" not in table.sources
    main = next(f for f in read_go_functions(image) if f.name == "main.main")
    assert table.lookup(main.entry) == cfi.NO_CFI
