"""Hot-context store: context ids, counting, bounded memory, and the metric promotion rule
(bounded series, monotonic counters, ``other`` = never-promoted contexts only)."""

from __future__ import annotations

import random

from daemon_fakes import frame, sample

from ccprofd.daemon.store import OTHER, TargetStore, context_id

S = 1_000_000_000
T0 = 1_700_000_000 * S


_SITES: dict[str, int] = {}


def ctx(*names: str) -> list[dict[str, object]]:
    """Frames with one call site per function name (the context id sees call sites, not names)."""
    return [frame(n, _SITES.setdefault(n, 0x1000 + 0x10 * len(_SITES))) for n in names]


def test_context_id_depends_on_build_id_and_call_sites_only() -> None:
    a = [frame("main", 0x1139), frame("work", 0x1150)]
    # Same frames as another tracer mode might report them: other names/return addresses, int sites.
    b = [dict(f, function=f"{f['function']}_renamed", return_address=None) for f in a]
    c = [dict(f, call_site=int(str(f["call_site"]), 16)) for f in a]
    assert context_id(a) == context_id(b) == context_id(c)
    assert len(context_id(a)) == 12 and int(context_id(a), 16) >= 0
    assert context_id(a) != context_id([a[0], frame("work", 0x1151)])  # other call site
    assert context_id(a) != context_id([a[0], dict(a[1], build_id="ff" * 20)])  # other binary
    assert context_id(a) != context_id(a[::-1])  # order matters
    assert context_id(a) != context_id(a, complete=False)  # a suffix is not a whole chain
    assert context_id(a[:1]) != context_id(a)


def test_counts_per_syscall_and_context() -> None:
    store = TargetStore()
    for _ in range(7):
        store.add(sample(ctx("main", "a")), T0)
    for _ in range(3):
        store.add(sample(ctx("main", "a"), "openat"), T0)
    store.add(sample(ctx("main", "b")), T0)
    store.add(sample(ctx("main", "b"), complete=False), T0)
    hot = store.hot("syscall", 10)
    rows = [(h.syscall, h.count, h.leaf, h.complete) for h in hot]
    assert rows[:2] == [("write", 7, "a", True), ("openat", 3, "a", True)]
    assert sorted(rows[2:]) == [("write", 1, "b", False), ("write", 1, "b", True)]  # tie: any order
    assert hot[0].frames[1]["function"] == "a" and hot[0].frames[1]["call_site"] == "0x1010"
    assert store.total("syscall") == 12 and store.total("syscall", syscall="openat") == 3
    assert store.counters()["incomplete"] == 1
    assert store.hot("syscall", 1)[0].count == 7 and store.hot("cpu", 5) == []


def test_since_uses_time_buckets() -> None:
    store = TargetStore(bucket_seconds=10, history_seconds=3600)
    store.add(sample(ctx("main", "old")), T0)
    store.add(sample(ctx("main", "new")), T0 + 100 * S)
    store.add(sample(ctx("main", "new")), T0 + 101 * S)
    assert [(h.leaf, h.count) for h in store.hot("syscall", 5, since_ns=T0 + 50 * S)] == [("new", 2)]
    assert {h.leaf: h.count for h in store.hot("syscall", 5)} == {"old": 1, "new": 2}
    assert store.total("syscall", since_ns=T0 + 50 * S) == 2


def series_map(store: TargetStore, now: int) -> dict[tuple[str, str], int]:
    return {(s.syscall, s.context): s.value for s in store.scrape(now)}


def test_promotion_keeps_series_monotonic_and_other_for_never_promoted() -> None:
    store = TargetStore(top_k=2, max_series=3, promotion_window_seconds=60)
    hot1, hot2, cold = ctx("main", "h1"), ctx("main", "h2"), ctx("main", "c")
    for _ in range(10):
        store.add(sample(hot1), T0)
    for _ in range(5):
        store.add(sample(hot2), T0)
    store.add(sample(cold), T0)
    first = series_map(store, T0 + S)
    # Contexts promoted at their first scrape are exported with their full counts.
    assert first == {("write", context_id(hot1)): 10, ("write", context_id(hot2)): 5, ("write", OTHER): 1}
    # Later: a new context becomes the hottest; hot1 goes cold but stays exported, unchanged.
    hot3 = ctx("main", "h3")
    for _ in range(20):
        store.add(sample(hot3), T0 + 120 * S)
    store.add(sample(cold), T0 + 120 * S)
    second = series_map(store, T0 + 121 * S)
    assert second[("write", context_id(hot1))] == 10 and second[("write", context_id(hot2))] == 5
    assert second[("write", context_id(hot3))] == 20
    assert second[("write", OTHER)] == 2  # only the never-promoted context
    assert sum(second.values()) == store.total("syscall") == 37
    # max_series reached: a further hot context stays in "other"; exported series never shrink.
    hot4 = ctx("main", "h4")
    for _ in range(50):
        store.add(sample(hot4), T0 + 240 * S)
    third = series_map(store, T0 + 241 * S)
    assert ("write", context_id(hot4)) not in third and third[("write", OTHER)] == 52
    for key, value in second.items():
        assert third[key] >= value


def test_late_promotion_moves_only_unexported_samples() -> None:
    """A context that was already counted in an exported "other" keeps those samples there."""
    store = TargetStore(top_k=1, max_series=5, promotion_window_seconds=60)
    a, b = ctx("main", "a"), ctx("main", "b")
    for _ in range(3):
        store.add(sample(a), T0)
    store.add(sample(b), T0)
    assert series_map(store, T0 + S) == {("write", context_id(a)): 3, ("write", OTHER): 1}
    for _ in range(4):
        store.add(sample(b), T0 + 200 * S)  # a is out of the window now, b is the top-1
    after = series_map(store, T0 + 201 * S)
    assert after == {("write", context_id(a)): 3, ("write", context_id(b)): 4, ("write", OTHER): 1}


def test_random_streams_keep_every_counter_monotonic_and_the_sum_exact() -> None:
    rng = random.Random(7)
    store = TargetStore(
        top_k=3,
        max_series=6,
        max_contexts=40,
        promotion_window_seconds=30,
        bucket_seconds=5,
        history_seconds=60,
    )
    contexts = [ctx("main", f"f{i}") for i in range(60)]
    seen: dict[tuple[str, str], int] = {}
    now = T0
    for _ in range(40):
        for _ in range(rng.randrange(1, 80)):
            store.add(
                sample(rng.choice(contexts[: rng.randrange(1, 61)]), rng.choice(["write", "read"])), now
            )
        now += rng.randrange(1, 20) * S
        exported = series_map(store, now)
        for key, value in seen.items():
            assert exported.get(key, -1) >= value, key
        seen = exported
        assert sum(exported.values()) == store.samples
        assert len([k for k in exported if k[1] != OTHER]) <= 6


def test_full_table_counts_new_contexts_as_dropped_not_lost() -> None:
    store = TargetStore(max_contexts=2, history_seconds=60, bucket_seconds=10)
    store.add(sample(ctx("main", "a")), T0)
    store.add(sample(ctx("main", "b")), T0)
    store.add(sample(ctx("main", "c")), T0 + S)
    assert store.context_count() == 2
    assert store.counters()["dropped"] == {"context_table_full": 1}
    exported = series_map(store, T0 + 2 * S)
    assert sum(exported.values()) == 3  # still counted (under "other" or its own series)
    # After the history, an old never-promoted context may be evicted to make room.
    store2 = TargetStore(max_contexts=1, history_seconds=60, bucket_seconds=10)
    store2.add(sample(ctx("main", "a")), T0)
    store2.add(sample(ctx("main", "b")), T0 + 120 * S)
    assert [h.leaf for h in store2.hot()] == ["b"]
    assert store2.counters()["dropped"] == {"context_evicted": 1}
    assert sum(v for v in series_map(store2, T0 + 121 * S).values()) == 2


def test_frames_are_interned_across_contexts() -> None:
    store = TargetStore()
    prefix = [frame(f"f{i}", 0x2000 + i) for i in range(50)]
    for leaf in range(20):
        store.add(sample([*prefix, frame(f"leaf{leaf}", 0x3000 + leaf)]), T0)
    assert store.counters()["frames"] == 50 + 20


def test_cpu_contexts_are_keyed_by_function_not_by_sampled_instruction() -> None:
    """Issue 17: a CPU sample's innermost frame carries the sampled address as its call site; one
    busy function gave a series per instruction (5 for one function in a real daemon)."""
    store = TargetStore(top_k=10, max_series=10)
    main = frame("main", 0x1193)
    # The same function sampled at five instructions: one context, all samples in it.
    for pc in (0x1150, 0x1155, 0x1158, 0x115C, 0x1160):
        store.add(sample([main, frame("burn", pc)], event="cpu"), T0)
    store.add(sample([main, frame("emit", 0x1170)], event="cpu"), T0)
    hot = {h.leaf: h.count for h in store.hot("cpu", 10)}
    assert hot == {"burn": 5, "emit": 1}
    cpu = [s for s in store.scrape(T0 + S) if s.event == "cpu" and s.context != OTHER]
    assert sorted((s.leaf, s.value) for s in cpu) == [("burn", 5), ("emit", 1)]
    # The outer frames' call sites still tell chains apart: burn called from another site of main.
    store.add(sample([frame("main", 0x11A0), frame("burn", 0x1150)], event="cpu"), T0)
    assert sorted(h.count for h in store.hot("cpu", 10)) == [1, 1, 5]
    # A CPU sample inside a library keeps the program's call into it (a call, not an instruction).
    lib = {"function": "memcpy", "module": "/lib/libc.so.6", "build_id": "aa" * 20, "analysed": False,
           "call_site": "0x9999"}
    a = store.context_of(sample([main, frame("emit", 0x1170), lib], event="cpu"))
    b = store.context_of(sample([main, frame("emit", 0x1178), lib], event="cpu"))
    assert a != b
    # Syscall samples keep the innermost call site: two calls of write are two contexts.
    assert store.context_of(sample([main, frame("emit", 0x1170)])) != \
        store.context_of(sample([main, frame("emit", 0x1178)]))


def _lib(function: str, ret: str | None) -> dict[str, object]:
    return {"function": function, "module": "/lib64/ld-linux-x86-64.so.2", "build_id": "7e" * 20,
            "analysed": False, "call_site": None, "return_address": ret}


def test_a_chain_without_program_frames_is_keyed_by_its_library_frames() -> None:
    """The dynamic loader's syscalls (unwind mode reports their ld.so frames): two loader chains are
    two contexts, each counted under its own frames; a library leaf below program frames still does
    not change the program chain's id."""
    cache = [_lib("_dl_start", "0x1bccc"), _lib("_dl_map_object", "0x135e4"), _lib("__open_nocancel", None)]
    deps = [_lib("_dl_start", "0x1bccc"), _lib("_dl_map_object", "0x2261"), _lib("__open_nocancel", None)]
    assert context_id(cache) != context_id(deps)
    assert context_id(cache) != context_id([])  # not the empty context of instrumented mode
    assert context_id(cache) == context_id([dict(f) for f in cache])
    store = TargetStore()
    for _ in range(3):
        store.add(sample(cache, "openat"), T0)
    store.add(sample(deps, "openat"), T0)
    hot = sorted(((h.count, [f["return_address"] for f in h.frames]) for h in store.hot("syscall", 10)),
                 key=lambda t: -t[0])
    assert hot == [(3, ["0x1bccc", "0x135e4", None]), (1, ["0x1bccc", "0x2261", None])]
    program = ctx("main", "emit")
    assert context_id([*program, _lib("write", None)]) == context_id(program)


def test_a_shared_frames_list_gives_the_id_its_contents_give() -> None:
    """context_of remembers a frames list by identity (tracers share one list per context); the id
    must still be the one the contents give, whether the list is shared, a copy, or reused with
    another completeness or event (a CPU sample drops its innermost call site)."""
    store = TargetStore()
    shared = [frame("main", 0x1193), frame("emit", 0x1170)]
    first = store.context_of(sample(shared))
    assert store.context_of(sample(shared, pid=1, tid=2)) == first == context_id(shared)
    assert store.context_of(sample([dict(f) for f in shared])) == first
    assert store.context_of(sample(shared, complete=False)) == context_id(shared, complete=False) != first
    cpu = store.context_of(sample(shared, event="cpu"))
    assert cpu == context_id([shared[0], dict(shared[1], call_site=None)]) != first
    assert store.context_of(sample(shared)) == first  # the other kinds did not replace it wrongly
    assert store.context_of(sample(shared, complete=False)) != first
    assert store.context_of(sample(shared, event="cpu")) == cpu


def test_series_not_seen_for_retire_after_are_retired_within_the_bound() -> None:
    """Issue 17: promoted series never retired.  A context not seen for retire_after_seconds
    leaves the exposition and frees its max_series slot; seen again, it is promoted again and its
    series resumes from its last value (monotonic).  The clock is injected, nothing sleeps."""
    now = [T0]
    store = TargetStore(top_k=2, max_series=2, promotion_window_seconds=60, retire_after_seconds=600,
                        clock=lambda: now[0])
    a, b, c = ctx("main", "ra"), ctx("main", "rb"), ctx("main", "rc")
    for _ in range(3):
        store.add(sample(a))
    store.add(sample(b))
    assert series_map(store, now[0]) == {("write", context_id(a)): 3, ("write", context_id(b)): 1,
                                         ("write", OTHER): 0}
    # b keeps being seen, a does not; c is hot but max_series = 2 is reached: c stays in "other".
    now[0] = T0 + 300 * S
    store.add(sample(b))
    for _ in range(5):
        store.add(sample(c))
    assert series_map(store, now[0]) == {("write", context_id(a)): 3, ("write", context_id(b)): 2,
                                         ("write", OTHER): 5}
    # 600 s after a's last sample: a is retired and c takes its slot with its unexported samples.
    now[0] = T0 + 600 * S + 1
    store.add(sample(b))
    store.add(sample(c))
    third = series_map(store, now[0])
    assert third == {("write", context_id(b)): 3, ("write", context_id(c)): 1, ("write", OTHER): 5}
    assert store.counters()["retired"] == 1
    # Exported series never exceed max_series; a seen again waits for a slot in "other".
    now[0] = T0 + 1000 * S
    store.add(sample(a))
    store.add(sample(c))
    fourth = series_map(store, now[0])
    assert context_id(a) not in {k[1] for k in fourth} and fourth[("write", OTHER)] == 6
    # b retires (last seen at T0 + 600 s): a is promoted again and resumes from 3 (monotonic);
    # the sample it had in "other" stays there (already exported).
    now[0] = T0 + 1300 * S
    store.add(sample(a))
    fifth = series_map(store, now[0])
    assert fifth == {("write", context_id(a)): 4, ("write", context_id(c)): 2, ("write", OTHER): 6}
    assert store.counters()["retired"] == 2
    # Retirement off (0): nothing ever leaves.
    keep = TargetStore(top_k=1, max_series=1, retire_after_seconds=0)
    keep.add(sample(a), T0)
    keep.scrape(T0 + S)
    assert series_map(keep, T0 + 10**6 * S)[("write", context_id(a))] == 1


def test_frames_keep_source_lines_and_inlined_calls() -> None:
    """The store keeps a frame's DWARF ``file``/``line``/``inlined`` (lists are not hashable: they
    are interned as tuples and given back as the tracer wrote them); a frame without them gets no
    such keys; the context id ignores them (the same call sites are one context)."""
    lined = [dict(frame("main", 0x1139), file="/src/a.c", line=9),
             dict(frame("work", 0x1150), file="/src/a.c", line=3,
                  inlined=[{"function": "note", "file": "/src/n.h", "line": 2}])]
    plain = [frame("main", 0x1139), frame("work", 0x1150)]
    store = TargetStore()
    assert store.add({"syscall": "write", "frames": lined}) == context_id(plain)
    assert store.add({"syscall": "write", "frames": plain}) == context_id(plain)
    store.add({"syscall": "read", "frames": plain})
    resolved = store.resolve(context_id(plain))
    assert resolved is not None
    assert [dict(f) for f in resolved[1]] == [dict(f, tail_call=None) for f in lined]
    (read,) = store.hot(syscall="read")
    assert [dict(f) for f in read.frames] == [dict(f, tail_call=None) for f in plain]


def test_retune_applies_a_reloaded_bound_to_a_running_store() -> None:
    """A reload's lower max_series retires the series seen longest ago until the bound holds; the
    kept series continue, the counts are untouched, and a retired one resumes monotonic."""
    now = [T0]
    store = TargetStore(top_k=3, max_series=3, promotion_window_seconds=60, clock=lambda: now[0])
    a, b, c = ctx("main", "ra"), ctx("main", "rb"), ctx("main", "rc")
    for i, chain in enumerate((a, b, c)):
        now[0] = T0 + i * S
        store.add(sample(chain))
    assert len(series_map(store, now[0])) == 4  # three series and "other"
    store.retune(max_contexts=10000, top_k=1, max_series=1, promotion_window_seconds=60,
                 retire_after_seconds=0)
    assert series_map(store, now[0]) == {("write", context_id(c)): 1, ("write", OTHER): 0}
    assert store.counters()["retired"] == 2 and store.samples == 3
    # Raised again: a, still hot in the window, is promoted again from its last value.
    store.retune(max_contexts=10000, top_k=3, max_series=3, promotion_window_seconds=60,
                 retire_after_seconds=0)
    store.add(sample(a))
    assert series_map(store, now[0])[("write", context_id(a))] == 2
