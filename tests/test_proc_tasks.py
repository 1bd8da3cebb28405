"""/proc/PID/task listing (ccprofd/proc/tasks.py) on a fake proc root and on this process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ccprofd.proc.tasks import list_threads, threads_of


def test_fake_proc_root(tmp_path: Path) -> None:
    for tid in ("12", "3", "100"):
        (tmp_path / "7" / "task" / tid).mkdir(parents=True)
    (tmp_path / "7" / "task" / "not-a-tid").mkdir()
    assert list_threads(7, str(tmp_path)) == [3, 12, 100]
    assert threads_of(7, str(tmp_path)) == [3, 12, 100]
    assert threads_of(8, str(tmp_path)) == []
    with pytest.raises(FileNotFoundError):
        list_threads(8, str(tmp_path))


def test_this_process_threads_match_threading() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        tids = list_threads(os.getpid())
        assert os.getpid() in tids and t.native_id in tids
        assert tids == sorted(int(x) for x in os.listdir(f"/proc/{os.getpid()}/task"))
    finally:
        stop.set()
        t.join()
