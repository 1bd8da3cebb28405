"""Granularity "routines" (issue 14): "edges", plus one new call into a routine shared for the
syscall (learned making it from 2 or more call sites) from a call path learned for any syscall.

The shapes are those of the false alerts left on postgres and redis by "edges" (a lock that makes
``futex`` only under contention, reached from a caller whose lock call never contended in training;
an allocator's ``madvise`` purge under a free that never purged in training) and of the injected
attacks (a function never seen making any syscall reaches a file-open routine).  Models are learned
from hand-built samples with the real :class:`Learner`; every verdict is derived by hand from the
chains written next to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from test_anomaly_model import BID, sample

from ccprofd.anomaly.detector import Detector, DetectorOptions
from ccprofd.anomaly.model import (
    Learner,
    ModelSet,
    TargetModel,
    context_edge_path,
    context_key,
    routine_junction,
    shared_routines,
)

# The lock: lock_acquire@0x50 -> sem_wait@0x60 -> futex (contention only).
LOCK = [("lock_acquire", "0x50"), ("sem_wait", "0x60")]
# Two callers contended in training: lock_acquire is a shared routine of futex.
CMD_A_LOCK = [("main", "0x10"), ("cmd_a", "0x20"), *LOCK]
CMD_B_LOCK = [("main", "0x14"), ("cmd_b", "0x24"), *LOCK]
# cmd_c ran in training (it read through read_helper) but its lock call never contended.
CMD_C_READ = [("main", "0x18"), ("cmd_c", "0x2c"), ("read_helper", "0x70")]
CMD_C_LOCK = [("main", "0x18"), ("cmd_c", "0x28"), *LOCK]  # held out: contention at cmd_c@0x28
# A function never seen making any syscall calls the lock: main@0x1c -> evil is unseen for every
# syscall, and it comes before the junction.
EVIL_LOCK = [("main", "0x1c"), ("evil", "0x90"), *LOCK]
# Two new edges: cmd_c@0x30 -> helper (never seen) and helper@0x80 -> lock_acquire (never seen).
TWO_NEW = [("main", "0x18"), ("cmd_c", "0x30"), ("helper", "0x80"), *LOCK]
# The junction is known but the routine's tail goes a new way: lock_acquire@0x54 -> sem_wait.
NEW_TAIL = [("main", "0x18"), ("cmd_c", "0x28"), ("lock_acquire", "0x54"), ("sem_wait", "0x60")]


def learned(*pairs: tuple[str, list[tuple[str, str]]]) -> TargetModel:
    model = TargetModel(BID, "/bin/prog")
    learner = Learner(model)
    for syscall, chain in pairs:
        learner.observe(sample(syscall, chain))
    return model


def det(model: TargetModel, granularity: str, **kw: Any) -> Detector:
    return Detector(model, DetectorOptions(granularity=granularity, alert_interval_seconds=0, **kw))


TRAINED = (("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK), ("read", CMD_C_READ))


def test_shared_routines_by_hand() -> None:
    model = learned(*TRAINED)
    # futex: lock_acquire has callers cmd_a@0x20 and cmd_b@0x24 (2: shared); sem_wait has one caller
    # (lock_acquire@0x50); cmd_a, cmd_b have one each (main@0x10, main@0x14); main none (entry).
    # read: every function has one caller.
    assert shared_routines(model.edges()) == {("futex", (BID, "lock_acquire"))}
    # min_count 2: each edge was learned once.
    assert shared_routines(model.edges(), need=2) == set()
    # A routine's own recursion is no second caller.
    rec = learned(("brk", [("main", "0x10"), ("walk", "0x40"), ("walk", "0x40"), ("walk", "0x44")]))
    assert shared_routines(rec.edges()) == set()


def test_contention_at_a_known_caller_accepted_by_routines_only() -> None:
    model = learned(*TRAINED)
    [alert] = det(model, "edges").check(sample("futex", CMD_C_LOCK))
    # "edges" judges per syscall: main@0x18 -> cmd_c was learned for read only.
    assert alert.unseen_edge is not None
    assert (alert.unseen_edge["caller"]["function"], alert.unseen_edge["caller"]["call_site"],
            alert.unseen_edge["callee"]["function"]) == ("main", "0x18", "cmd_c")
    routines = det(model, "routines")
    assert routines.check(sample("futex", CMD_C_LOCK)) == []
    # The junction is the call cmd_c@0x28 -> lock_acquire (the 3rd edge: entry, main@0x18 -> cmd_c).
    assert routines.junction(context_key(sample("futex", CMD_C_LOCK))) == (
        (BID, "cmd_c", "0x28"), (BID, "lock_acquire"))
    assert det(model, "exact").check(sample("futex", CMD_C_LOCK)) != []


def test_function_never_seen_making_a_syscall_still_alerted() -> None:
    model = learned(*TRAINED)
    [alert] = det(model, "routines").check(sample("futex", EVIL_LOCK))
    # The first edge unseen for futex is named, as in "edges".
    assert (alert.unseen_edge["caller"]["function"], alert.unseen_edge["callee"]["function"]) == (  # type: ignore[index]
        "main", "evil")


def test_two_new_edges_alerted() -> None:
    model = learned(*TRAINED)
    assert len(det(model, "routines").check(sample("futex", TWO_NEW))) == 1


def test_tail_after_the_junction_must_be_learned_for_the_syscall() -> None:
    model = learned(*TRAINED)
    assert len(det(model, "routines").check(sample("futex", NEW_TAIL))) == 1
    # The same shape for another syscall: lock_acquire is shared for futex, not for openat.
    assert len(det(model, "routines").check(sample("openat", CMD_C_LOCK))) == 1


def test_routine_called_from_one_site_is_not_shared() -> None:
    model = learned(("futex", CMD_A_LOCK), ("read", CMD_C_READ))
    assert len(det(model, "routines").check(sample("futex", CMD_C_LOCK))) == 1


def test_prefix_must_be_learned_for_some_syscall() -> None:
    # cmd_c never ran in training: main@0x18 -> cmd_c is unseen for every syscall.
    model = learned(("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK))
    assert len(det(model, "routines").check(sample("futex", CMD_C_LOCK))) == 1


def test_min_count_applies_to_prefix_tail_and_sharing() -> None:
    model = learned(*TRAINED, *TRAINED)
    assert det(model, "routines", min_count=2).check(sample("futex", CMD_C_LOCK)) == []
    assert len(det(model, "routines", min_count=3).check(sample("futex", CMD_C_LOCK))) == 1


def test_routine_junction_by_hand() -> None:
    path = context_edge_path(context_key(sample("futex", CMD_C_LOCK))[1])
    # entry->main, main@0x18->cmd_c, cmd_c@0x28->lock_acquire, lock_acquire@0x50->sem_wait,
    # sem_wait@0x60->futex.
    assert len(path) == 5
    known_any = {path[0], path[1]}
    known_futex = {path[3], path[4]}
    def shared(sc: str, fn: tuple[str, str]) -> bool:
        return fn == (BID, "lock_acquire")
    assert routine_junction("futex", path, known_futex.__contains__, known_any.__contains__, shared) == 2
    # main@0x18 -> cmd_c not learned for any syscall: nothing after it can be a junction.
    assert routine_junction("futex", path, known_futex.__contains__, {path[0]}.__contains__, shared) is None
    # sem_wait@0x60 -> futex not learned for futex: the tail after the junction fails.
    assert routine_junction("futex", path, {path[3]}.__contains__, known_any.__contains__, shared) is None
    # Repeats are kept in the path (recursion), unlike context_edges.
    rec = context_edge_path(context_key(sample("brk", [("walk", "0x40")] * 3))[1])
    assert len(rec) == 4 and len(set(rec)) == 3


def test_version_1_model_file_works_in_routines_mode() -> None:
    # A model file as `ccprofd learn` wrote it before this granularity (format version 1, unchanged).
    doc = {"format": "ccprofd-anomaly-model", "version": 1, "targets": [{
        "build_id": BID, "path": "/bin/prog", "runs": 3, "runs_with_transitions": 0, "samples": 3,
        "incomplete_skipped": 0, "syscalls": None, "modules": [{"id": BID, "path": "/bin/prog"}],
        "contexts": [
            {"syscall": sc, "frames": [[0, fn, site] for fn, site in chain], "count": 1, "first_ns": 0,
             "last_ns": 0} for sc, chain in TRAINED],
        "transitions": [], "allow_rules": [], "return_addresses": []}]}
    model = ModelSet.from_dict(json.loads(json.dumps(doc))).targets[BID]
    assert det(model, "routines").check(sample("futex", CMD_C_LOCK)) == []
    assert len(det(model, "routines").check(sample("futex", EVIL_LOCK))) == 1


def test_routines_refused_with_transitions_and_enforcement(tmp_path: Any) -> None:
    model = learned(*TRAINED)
    with pytest.raises(ValueError, match="exact contexts"):
        Detector(model, DetectorOptions(granularity="routines", transitions=True))
    from ccprofd.anomaly.modelstore import save_models
    models = ModelSet()
    models.targets[BID] = model
    path = tmp_path / "m.json"
    save_models(str(path), models)
    r = subprocess.run([sys.executable, "-m", "ccprofd.cli", "detect", "--model", str(path), "--granularity",
                        "routines", "--enforce", "--", "/bin/true"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "routines cannot be enforced" in r.stderr


def test_detect_samples_cli_in_routines_mode(tmp_path: Any) -> None:
    from ccprofd.anomaly.modelstore import save_models
    models = ModelSet()
    models.targets[BID] = learned(*TRAINED)
    path = tmp_path / "m.json"
    save_models(str(path), models)
    samples = tmp_path / "s.jsonl"
    held = [sample("futex", CMD_C_LOCK, t=1), sample("futex", EVIL_LOCK, t=2)]
    samples.write_text("".join(json.dumps(s) + "\n" for s in held))
    r = subprocess.run([sys.executable, "-m", "ccprofd.cli", "detect", "--model", str(path), "--granularity",
                        "routines", "--alert-interval", "0", "--samples", str(samples)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    alerts = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    assert [(a["time_ns"], a["unseen_edge"]["callee"]["function"]) for a in alerts] == [(2, "evil")]


def test_unnamed_allocator_frames_as_in_redis_jemalloc() -> None:
    # redis' false alert left by "edges": jemalloc's frames have no symbol (function "?", no call
    # site), so every jemalloc frame is the same key and its inner edges are self edges.  Training
    # saw the purge (madvise) under listDelNode@0x61ce1 and under jemalloc's exported calloc (called
    # by zcalloc_num@0x7bd06); freeClient@0x843b4 frees without a purge in training (its path made
    # `close` through freeClient@0x84000).
    lib = "cd" * 20

    def chain(*prog: tuple[str, str], inner: int) -> dict[str, Any]:
        s = sample("madvise", list(prog))
        s["frames"] += [{"function": None, "module": "/lib/libjemalloc.so.2", "build_id": lib,
                         "call_site": None, "return_address": "0x1"} for _ in range(inner)]
        s["frames"].append({"function": "madvise", "module": "/lib/libc.so.6", "build_id": "ef" * 20,
                            "call_site": None, "return_address": "0x2"})
        return s

    top = [("main", "0x61211"), ("aeMain", "0x659e8")]
    model = TargetModel(BID, "/bin/redis")
    learner = Learner(model)
    learner.observe(chain(*top, ("listDelNode", "0x61ce1"), inner=7))
    calloc = chain(*top, ("zcalloc_num", "0x7bd06"), inner=5)
    calloc["frames"].insert(3, {"function": "calloc", "module": "/lib/libjemalloc.so.2", "build_id": lib,
                                "call_site": None, "return_address": "0x3"})
    learner.observe(calloc)
    learner.observe(sample("close", [*top, ("freeClient", "0x84000"), ("close", "0x90")]))
    assert ("madvise", (lib, "?")) in shared_routines(model.edges())  # callers listDelNode@, calloc
    held = chain(*top, ("freeClient", "0x843b4"), inner=7)
    [alert] = det(model, "edges").check(held)
    assert alert.unseen_edge["caller"]["function"] == "aeMain"  # type: ignore[index]  # for madvise
    assert det(model, "routines").check(held) == []
    # The same purge under a function never seen making a syscall still alerts.
    assert len(det(model, "routines").check(chain(*top, ("evil", "0x1"), inner=7))) == 1


def cpu_sample(chain: list[tuple[str, str]], *, complete: bool = True) -> dict[str, Any]:
    """A CPU sample as the tracer writes it: ``"event": "cpu"``, no syscall, the innermost frame's
    ``call_site`` is the sampled pc and it has no return address."""
    s = sample("futex", chain, complete=complete)
    s["event"], s["syscall"] = "cpu", None
    s["frames"][-1]["return_address"] = None
    return s


def test_cpu_samples_show_a_path_running_for_routines_only() -> None:
    # cmd_c never made a syscall in training, so main@0x18 -> cmd_c is unseen for every syscall and
    # its contended lock alerts (test_prefix_must_be_learned_for_some_syscall).  A CPU sample caught
    # cmd_c running (at pc 0x2a, under main@0x18): the path ran, so "routines" accepts the lock's
    # futex at cmd_c@0x28; "edges" and "exact" judge syscall contexts only and still alert.
    running = cpu_sample([("main", "0x18"), ("cmd_c", "0x2a")])
    model = learned(("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK))
    Learner(model).observe(running)
    assert model.calls == {(None, (BID, "main")): 1, ((BID, "main", "0x18"), (BID, "cmd_c")): 1}
    assert len(model.contexts) == 2  # no context learned from it
    assert det(model, "routines").check(sample("futex", CMD_C_LOCK)) == []
    assert len(det(model, "edges").check(sample("futex", CMD_C_LOCK))) == 1
    assert len(det(model, "exact").check(sample("futex", CMD_C_LOCK))) == 1
    # evil was never seen running: still alerted, naming main@0x1c -> evil.
    [alert] = det(model, "routines").check(sample("futex", EVIL_LOCK))
    assert alert.unseen_edge is not None and alert.unseen_edge["callee"]["function"] == "evil"
    # The sampled pc is no call: a CPU sample in main at 0x1c does not make main@0x1c -> evil seen.
    Learner(model).observe(cpu_sample([("main", "0x1c")]))
    assert len(det(model, "routines").check(sample("futex", EVIL_LOCK))) == 1


def test_cpu_sample_evidence_needs_complete_samples_and_min_count() -> None:
    lock_twice = (("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK)) * 2  # every lock edge learned twice
    model = learned(*lock_twice)
    running = [("main", "0x18"), ("cmd_c", "0x2a")]
    Learner(model).observe(cpu_sample(running, complete=False))  # an unknown prefix shows nothing
    assert model.calls == {}
    assert len(det(model, "routines").check(sample("futex", CMD_C_LOCK))) == 1
    Learner(model).observe(cpu_sample(running))
    assert det(model, "routines").check(sample("futex", CMD_C_LOCK)) == []
    # min_count 2 asks for 2 CPU samples through main@0x18 -> cmd_c as for 2 of every learned edge
    assert len(det(model, "routines", min_count=2).check(sample("futex", CMD_C_LOCK))) == 1
    Learner(model).observe(cpu_sample(running))
    assert det(model, "routines", min_count=2).check(sample("futex", CMD_C_LOCK)) == []


def test_cpu_calls_survive_the_model_file_and_merge() -> None:
    model = learned(("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK))
    Learner(model).observe(cpu_sample([("main", "0x18"), ("cmd_c", "0x2a")]))
    models = ModelSet()
    models.targets[BID] = model
    doc = json.loads(json.dumps(models.to_dict()))
    assert doc["targets"][0]["calls"] == [[-1, None, None, 0, "main", 1],
                                          [0, "main", "0x18", 0, "cmd_c", 1]]
    back = ModelSet.from_dict(doc).targets[BID]
    assert back.calls == model.calls
    back.merge(model)
    assert back.calls[((BID, "main", "0x18"), (BID, "cmd_c"))] == 2
    assert det(back, "routines").check(sample("futex", CMD_C_LOCK)) == []
    # A caller without a call site (a libc frame's) sorts beside one with a site, and round-trips.
    back.calls[((BID, "lib", None), (BID, "x"))] = 1
    back.calls[((BID, "lib", "0x1"), (BID, "x"))] = 1
    again = ModelSet.from_dict(json.loads(json.dumps(ModelSet({BID: back}).to_dict()))).targets[BID]
    assert again.calls == back.calls


# prefix_match = "functions" (the postgres shape left with CPU samples: a known caller -> callee pair
# at a call site that neither made a syscall nor was sampled running in training).
# cmd_c calls the lock from 0x28 in training (contention there); held out, its *other* call site
# of cmd_c by main, 0x1a (a rare branch), leads to the same lock: main@0x1a -> cmd_c was never seen.
CMD_C_OTHER_SITE = [("main", "0x1a"), ("cmd_c", "0x28"), *LOCK]
TRAINED_SITES = (("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK), ("read", CMD_C_READ))


def test_prefix_match_functions_accepts_a_known_call_at_another_site() -> None:
    model = learned(*TRAINED_SITES)
    # main@0x1a -> cmd_c: not learned for any syscall at that site (main@0x18 -> cmd_c was, for read).
    assert len(det(model, "routines").check(sample("futex", CMD_C_OTHER_SITE))) == 1
    functions = det(model, "routines", prefix_match="functions")
    assert functions.check(sample("futex", CMD_C_OTHER_SITE)) == []
    # The junction is still the call into the shared lock (edge 3); the prefix edge is the relaxed one.
    assert functions.junction(context_key(sample("futex", CMD_C_OTHER_SITE))) == (
        (BID, "cmd_c", "0x28"), (BID, "lock_acquire"))
    # "edges" and "exact" ignore prefix matching: both alert (prefix_match is refused with them).
    assert len(det(model, "edges").check(sample("futex", CMD_C_OTHER_SITE))) == 1


def test_prefix_match_functions_still_alerts_new_functions_and_new_tails() -> None:
    model = learned(*TRAINED_SITES)
    functions = det(model, "routines", prefix_match="functions")
    # evil never called by main at any site: main -> evil unseen as a function pair too.
    [alert] = functions.check(sample("futex", EVIL_LOCK))
    assert (alert.unseen_edge["caller"]["function"], alert.unseen_edge["callee"]["function"]) == (  # type: ignore[index]
        "main", "evil")
    # The tail after the junction is matched by call site, as before: lock_acquire@0x54 -> sem_wait
    # was never learned for futex (lock_acquire@0x50 -> sem_wait was).
    assert len(functions.check(sample("futex", NEW_TAIL))) == 1
    # Two new function pairs in a row (cmd_c -> helper, helper -> lock_acquire): still alerted.
    assert len(functions.check(sample("futex", TWO_NEW))) == 1
    # The pair, not the caller alone: main -> cmd_b exists, cmd_b -> read_helper was never seen.
    cmd_b_read = [("main", "0x14"), ("cmd_b", "0x2c"), ("read_helper", "0x70")]
    assert len(functions.check(sample("read", cmd_b_read))) == 1


def test_prefix_match_functions_counts_every_site_of_the_pair_for_min_count() -> None:
    # The lock's chains learned 3 times (shared and its tail at min_count 3); main -> cmd_c learned
    # twice at 0x18 (read) and, in one model, once more at 0x19 (write): 2 or 3 sightings of the pair.
    futex = [("futex", CMD_A_LOCK), ("futex", CMD_B_LOCK)] * 3
    reads = [("read", CMD_C_READ)] * 2
    other = ("write", [("main", "0x19"), ("cmd_c", "0x2e"), ("write_helper", "0x74")])
    with_other = learned(*futex, *reads, other)
    without = learned(*futex, *reads)
    assert det(with_other, "routines", prefix_match="functions", min_count=3).check(
        sample("futex", CMD_C_OTHER_SITE)) == []
    assert len(det(without, "routines", prefix_match="functions", min_count=3).check(
        sample("futex", CMD_C_OTHER_SITE))) == 1
    assert det(without, "routines", prefix_match="functions", min_count=2).check(
        sample("futex", CMD_C_OTHER_SITE)) == []
    # By site, 0x1a was never seen at all.
    assert len(det(with_other, "routines", min_count=1).check(sample("futex", CMD_C_OTHER_SITE))) == 1


def test_prefix_match_refused_outside_routines_and_unknown_values(tmp_path: Any) -> None:
    model = learned(*TRAINED_SITES)
    for g in ("exact", "edges"):
        with pytest.raises(ValueError, match='applies to granularity "routines" only'):
            Detector(model, DetectorOptions(granularity=g, prefix_match="functions"))
    with pytest.raises(ValueError, match="expected one of sites, functions"):
        Detector(model, DetectorOptions(granularity="routines", prefix_match="calls"))
    from ccprofd.anomaly.modelstore import save_models
    models = ModelSet()
    models.targets[BID] = model
    path = tmp_path / "m.json"
    save_models(str(path), models)
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps(sample("futex", CMD_C_OTHER_SITE, t=1)) + "\n")
    base = [sys.executable, "-m", "ccprofd.cli", "detect", "--model", str(path), "--alert-interval", "0",
            "--samples", str(samples)]
    r = subprocess.run([*base, "--granularity", "edges", "--prefix-match", "functions"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "applies to --granularity routines" in r.stderr
    for match, alerts in (("sites", 1), ("functions", 0)):
        r = subprocess.run([*base, "--granularity", "routines", "--prefix-match", match],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert sum(x.startswith("{") for x in r.stderr.splitlines()) == alerts, (match, r.stderr)
