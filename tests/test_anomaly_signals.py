"""Signal handlers' syscalls are judged by the handler's own chain (issue 14, postgres).

A signal can land on any instruction, so the frames outward of the trampoline (``__restore_rt``)
are wherever the process happened to be: a model that keys them learns one context per place a
signal ever landed, and alerts on the next new one.  The samples below have the shape the unwind
tracer reports (seen in postgres's traces: a SIGALRM handler's ``setitimer`` under
``epoll_wait``, ``rt_sigreturn`` whose outer frames are the interrupted code): the interrupted frame
has neither call site nor return address, the trampoline is an unnamed libc frame with a return
address, the innermost frame (the libc wrapper making the syscall) has neither either.
"""

from __future__ import annotations

from typing import Any

import pytest

from ccprofd.anomaly.detector import Detector, DetectorOptions
from ccprofd.anomaly.model import (
    SIGNAL_SITE,
    Learner,
    TargetModel,
    context_key,
    signal_handler_part,
)

BID = "cd" * 20
LIBC = "93" * 20


def binary(fn: str, site: str) -> dict[str, Any]:
    return {"function": fn, "module": "/bin/srv", "build_id": BID, "analysed": True, "call_site": site,
            "return_address": hex(int(site, 16) + 5)}


def libc(fn: str | None, ret: str | None = None) -> dict[str, Any]:
    return {"function": fn, "module": "/lib/libc.so.6", "build_id": LIBC, "analysed": False,
            "call_site": None, "return_address": ret}


TRAMPOLINE = libc(None, "0x3c050")  # __restore_rt: the handler returns into it
HANDLER = [binary("handle_alarm", "0x5c61b5"), binary("schedule_alarm", "0x5c6079"), libc("setitimer")]
#: Two places the same SIGALRM landed: waiting in epoll_wait, or inside the binary's hash_search.
IN_WAIT = [binary("main", "0x10"), binary("serve", "0x20"), binary("wait_event", "0x44e139"),
           libc("epoll_wait")]
IN_HASH = [binary("main", "0x10"), binary("serve", "0x24"), binary("open_table", "0x1d1f9c"),
           {**binary("hash_search", "0x59a93b"), "call_site": None, "return_address": None}]


def sample(syscall: str, frames: list[dict[str, Any]], t: int = 0) -> dict[str, Any]:
    return {"time_ns": t, "pid": 7, "tid": 7, "event": "syscall", "syscall": syscall, "complete": True,
            "frames": frames}


def learned(*samples: dict[str, Any]) -> TargetModel:
    model = TargetModel(BID, "/bin/srv")
    learner = Learner(model)
    for s in samples:
        learner.observe(s)
    return model


def test_interrupted_frame_is_keyed_as_such() -> None:
    _, frames = context_key(sample("setitimer", [*IN_WAIT, TRAMPOLINE, *HANDLER]))
    sites = [f[2] for f in frames]
    # epoll_wait (interrupted) is marked; the innermost libc wrapper, also without a site, is not
    assert sites == ["0x10", "0x20", "0x44e139", SIGNAL_SITE, None, "0x5c61b5", "0x5c6079", None]
    assert signal_handler_part("setitimer", frames) == frames[4:]
    # a context no signal interrupted is kept whole (the innermost wrapper has no site either)
    _, plain = context_key(sample("epoll_wait", IN_WAIT))
    assert signal_handler_part("epoll_wait", plain) == plain and plain[-1][2] is None


@pytest.mark.parametrize("granularity", ["exact", "edges"])
def test_handler_syscall_wherever_the_signal_landed(granularity: str) -> None:
    det = Detector(learned(sample("setitimer", [*IN_WAIT, TRAMPOLINE, *HANDLER])),
                   DetectorOptions(granularity=granularity, alert_interval_seconds=0))
    # the same handler chain under another interrupted place: the same handler context
    assert det.check(sample("setitimer", [*IN_HASH, TRAMPOLINE, *HANDLER])) == []
    # the handler reaching setitimer through another call site is new, whatever it interrupted
    other = [binary("handle_alarm", "0x5c61c0"), *HANDLER[1:]]
    [alert] = det.check(sample("setitimer", [*IN_WAIT, TRAMPOLINE, *other]))
    assert alert.kind == "unseen_context"
    # and the same syscall made outside any handler is not the handler's context
    assert len(det.check(sample("setitimer", [*IN_WAIT[:3], *HANDLER]))) == 1


@pytest.mark.parametrize("granularity", ["exact", "edges"])
def test_rt_sigreturn_is_the_trampolines(granularity: str) -> None:
    # rt_sigreturn's innermost frame is the trampoline; outward is what the handler interrupted,
    # reported with or without the interrupted frame's marks
    ret_in_hash = [*IN_HASH[:3], binary("hash_search", "0x59a93b"), libc(None)]
    det = Detector(learned(sample("rt_sigreturn", [*IN_WAIT, libc(None)])),
                   DetectorOptions(granularity=granularity, alert_interval_seconds=0))
    assert det.check(sample("rt_sigreturn", ret_in_hash)) == []


def test_whole_contexts_when_asked() -> None:
    """split_signals=False keeps the old judgement: the interrupted part is part of the context."""
    det = Detector(learned(sample("setitimer", [*IN_WAIT, TRAMPOLINE, *HANDLER])),
                   DetectorOptions(split_signals=False, alert_interval_seconds=0))
    assert len(det.check(sample("setitimer", [*IN_HASH, TRAMPOLINE, *HANDLER]))) == 1
