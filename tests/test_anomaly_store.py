"""Model files: atomic writes, refusal to replace unreadable files, quarantine, locked merges from
several processes, periodic flushes, and a SIGKILL during learning."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_anomaly_model import BID, MAIN_OPEN, sample

from ccprofd.anomaly.model import Learner, ModelSet, context_key
from ccprofd.anomaly.modelstore import (
    ModelFileError,
    ModelStore,
    PeriodicFlusher,
    load_models,
    merge_into,
    quarantine,
    save_models,
)

KEY = context_key(sample("openat", MAIN_OPEN))


def one_run(n: int = 1) -> ModelSet:
    models = ModelSet()
    learner = Learner(models.target(BID, "/bin/prog"), syscalls=["openat"])
    for _ in range(n):
        learner.observe(sample("openat", MAIN_OPEN))
    return models


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert load_models(tmp_path / "none.json").targets == {}
    with pytest.raises(ModelFileError, match="does not exist"):
        load_models(tmp_path / "none.json", missing_ok=False)


def test_save_load_round_trip_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    save_models(path, one_run(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("ccprofd-anomaly-model", 1)
    assert load_models(path).targets[BID].contexts[KEY].count == 3


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe", b'{"format": "ccprofd-anomaly-model", "version": 99, "targets": []}',
    b'{"format": "other", "version": 1}', b"",
])
def test_unreadable_file_reported_and_never_replaced(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as info:
        load_models(path)
    assert str(path) in str(info.value)
    with pytest.raises(ModelFileError):
        merge_into(path, one_run())
    assert path.read_bytes() == content  # untouched


def test_quarantine_moves_aside(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("garbage")
    store = ModelStore(tmp_path)
    store.directory.mkdir()
    target_path = store.path_for("web/api server")
    assert target_path.parent == tmp_path / "anomaly" and "/" not in target_path.name
    target_path.write_text('{"format": "ccprofd-anomaly-model", "version": 7, "targets": []}')
    messages: list[str] = []
    models = store.open("web/api server", messages.append)
    assert models.targets == {}
    [moved] = [p for p in store.directory.iterdir() if ".corrupt-" in p.name]
    assert moved.read_text().startswith('{"format"') and not target_path.exists()
    assert len(messages) == 1 and "version 7" in messages[0] and str(moved) in messages[0]
    second = quarantine(path)
    assert second.read_text() == "garbage"


def _merge_worker(path: str, n: int) -> None:
    for _ in range(n):
        merge_into(path, one_run())


def test_concurrent_merges_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_merge_worker, args=(str(path), 15)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    model = load_models(path).targets[BID]
    assert model.runs == 45 and model.contexts[KEY].count == 45


def test_periodic_flusher_with_fake_clock(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    now = [0.0]
    models = ModelSet()
    learner = Learner(models.target(BID), syscalls=["openat"])
    flusher = PeriodicFlusher(path, learner, 5.0, clock=lambda: now[0])
    learner.observe(sample("openat", MAIN_OPEN))
    assert not flusher.maybe_flush() and not path.exists()
    now[0] = 5.0
    assert flusher.maybe_flush()
    learner.observe(sample("openat", MAIN_OPEN))
    learner.observe(sample("openat", MAIN_OPEN))
    now[0] = 7.0
    assert not flusher.maybe_flush()
    assert load_models(path).targets[BID].contexts[KEY].count == 1
    flusher.flush()
    model = load_models(path).targets[BID]
    assert model.contexts[KEY].count == 3 and model.runs == 1
    assert model.syscalls == frozenset({"openat"})


LEARNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_anomaly_model import BID, MAIN_OPEN, sample
    from ccprofd.anomaly.model import Learner, ModelSet
    from ccprofd.anomaly.modelstore import PeriodicFlusher
    learner = Learner(ModelSet().target(BID), syscalls=["openat"])
    flusher = PeriodicFlusher({path!r}, learner, 0.05)
    n = 0
    while True:
        learner.observe(sample("openat", MAIN_OPEN))
        n += 1
        if flusher.maybe_flush():
            print(n, flush=True)
        time.sleep(0.001)
""")


def test_sigkill_during_learning_loses_at_most_one_interval(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    code = LEARNER.format(tests=str(Path(__file__).parent), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.stdout is not None
    flushed = [int(proc.stdout.readline()) for _ in range(5)]
    time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rest = [int(x) for x in proc.stdout.read().split()]
    last_reported = (flushed + rest)[-1]
    model = load_models(path).targets[BID]  # a complete, readable file
    # Everything up to the last completed flush is there; at most the next interval is lost.
    assert model.contexts[KEY].count >= last_reported
    assert model.runs == 1
