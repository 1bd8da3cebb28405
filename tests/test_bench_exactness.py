"""bench/exactness.py: perf script parsing, pairing and frame comparison on a captured perf script
text (tests/fixtures/perf/redis_sys_enter.txt: four sys_enter events of redis-server recorded
with ``perf record -e raw_syscalls:sys_enter --call-graph dwarf -k mono``; the third one's chain was
cut by hand after ``cronUpdateMemoryStats``, as perf's 8 KB stack copy cuts deep stacks).  The
expected ccprofd frames are written by hand from redis' disassembly: the call instructions
(``objdump -d /usr/bin/redis-check-rdb``, below), and perf prints a caller's return address minus
one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import exactness as x

FIXTURE = Path(__file__).parent / "fixtures" / "perf" / "redis_sys_enter.txt"
REDIS = "/usr/bin/redis-check-rdb"
#: (call site, return address) outermost first, from objdump: main 0x61211 call aeMain; aeMain 0x659e8
#: call aeProcessEvents (local); 0x65046 ``call *0x10(%rbx)`` (3 bytes: the time event, serverCron);
#: 0x77c0a call cronUpdateMemoryStats; 0x6ba52 call zmalloc_get_rss; 0x7c56a call get_proc_stat_ll
CRON = [(0x61211, 0x61216), (0x659e8, 0x659ed), (0x65046, 0x65049), (0x77c0a, 0x77c0f),
        (0x6ba52, 0x6ba57), (0x7c56a, 0x7c56f)]
#: aeProcessEvents 0x64e4c call epoll_wait@plt
EPOLL = [(0x61211, 0x61216), (0x659e8, 0x659ed), (0x64e4c, 0x64e51)]
T0 = 25193_952330070  # the first event's time, ns


def ours(tid: int, t: int, nr: int, frames: list[tuple[int, int]], complete: bool = True) -> x.OurSample:
    return x.OurSample(22276, tid, t, nr, complete, frames)


def test_parse_perf_script() -> None:
    evs = x.parse_perf_script(FIXTURE.read_text())
    assert [(e.pid, e.tid, e.nr) for e in evs] == [(22276, 22276, 257), (22276, 22276, 0),
                                                  (22276, 22276, 3), (22276, 22276, 232)]
    assert evs[0].time_ns == T0 and evs[3].time_ns == 25193_952469010
    assert len(evs[0].frames) == 14 and len(evs[2].frames) == 7
    assert evs[0].frames[4] == (0x7c404, "get_proc_stat_ll", REDIS)
    assert evs[0].frames[3] == (0xf8090, "__libc_open64", "inlined")


def test_program_frames_leave_out_start_kernel_and_libraries() -> None:
    evs = x.parse_perf_script(FIXTURE.read_text())
    assert x.perf_program_frames(evs[3], REDIS) == ([0x61215, 0x659ec, 0x64e50], True)
    assert x.perf_program_frames(evs[2], REDIS) == ([0x6ba56, 0x7c56e, 0x7c437], False)


def test_recursion_through_one_call_site_is_kept() -> None:
    """A function calling itself from one call site puts the same return address on the stack
    once per level: each is a frame (not merged as perf's inlined entries are)."""
    ev = x.PerfEvent(1, 1, 0, 0, [(0x7c424, "get_proc_stat_ll", REDIS), (0x6ba56, "f", REDIS),
                                  (0x6ba56, "f", REDIS), (0x6ba56, "f [inlined g]", "inlined"),
                                  (0x61215, "main", REDIS)])
    assert x.perf_program_frames(ev, REDIS) == ([0x61215, 0x6ba56, 0x6ba56, 0x7c424], False)
    rec = [(0x61211, 0x61216), (0x6ba52, 0x6ba57), (0x6ba52, 0x6ba57), (0x7c420, 0x7c425)]
    assert x.compare([(ev, ours(1, 0, 0, rec))], REDIS)["agree"] == 1
    assert x.compare([(ev, ours(1, 0, 0, [rec[0], *rec[2:]]))], REDIS)["differ"] == 1


def test_compare_counts_each_kind() -> None:
    evs = x.parse_perf_script(FIXTURE.read_text())
    open_frames = [*CRON, (0x7c400, 0x7c405)]  # call open64@plt
    read_frames = [*CRON, (0x7c420, 0x7c425)]  # call read@plt
    close_frames = [*CRON, (0x7c433, 0x7c438)]  # call close@plt
    pairs = [(evs[0], ours(22276, 0, 257, open_frames)), (evs[1], ours(22276, 0, 0, read_frames)),
             (evs[2], ours(22276, 0, 3, close_frames)), (evs[3], ours(22276, 0, 232, EPOLL))]
    assert x.compare(pairs, REDIS) == {"agree": 3, "perf_truncated": 1, "differ": 0, "ours_incomplete": 0,
                                       "unmatched": 0}
    # a wrong caller (the read's frames for the open), a frame too many, incomplete, no partner
    wrong = [(evs[0], ours(22276, 0, 257, read_frames)), (evs[3], ours(22276, 0, 232, [*EPOLL, (1, 2)])),
             (evs[1], ours(22276, 0, 0, read_frames, complete=False)), (evs[2], None)]
    assert x.compare(wrong, REDIS) == {"agree": 0, "perf_truncated": 0, "differ": 2, "ours_incomplete": 1,
                                       "unmatched": 1}
    # a truncated perf chain whose frames are not ours' innermost ones is a difference
    assert x.compare([(evs[2], ours(22276, 0, 3, open_frames))], REDIS)["differ"] == 1


def test_pair_by_thread_syscall_and_time() -> None:
    """The clocks' offset is refined from the data (ours here 3 us later than the offset given);
    perf's lost ``read`` leaves ours unused; another thread's samples and a sample 1 ms off are
    never partners."""
    evs = x.parse_perf_script(FIXTURE.read_text())
    off = 1_000_000_000
    t = [e.time_ns + off + 3_000 for e in evs]
    mine = [ours(22276, t[0], 257, []), ours(22276, t[1], 0, []), ours(22276, t[2], 3, []),
            ours(22276, t[3] + 1_000_000, 232, []), ours(999, t[3], 232, [])]
    got = x.pair([evs[0], evs[2], evs[3]], mine, off)
    assert [(e.nr, s.time_ns - e.time_ns - off if s else None) for e, s in got] == [
        (257, 3_000), (3, 3_000), (232, None)]
    # each sample is used once: two perf events of one syscall, one sample of ours
    twice = x.pair([evs[0], evs[0]], mine[:1], off)
    assert [s is not None for _, s in twice] == [True, False]


def test_first_syscalls() -> None:
    assert x.first_syscalls([(5, 30, 1), (5, 10, 273), (6, 20, 0), (5, 20, 3)]) == {5: 273, 6: 0}
