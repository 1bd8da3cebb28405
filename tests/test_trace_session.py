"""Session lifecycle without BPF: what batches() does with its mode when the target is gone."""

from __future__ import annotations

from ccprofd.tracing.session import Session


class _ModeStub:
    """Just what Session.batches touches."""

    path = "/bin/true"
    build_id = None

    def __init__(self) -> None:
        self.detached = 0

    def poll(self, timeout_ms: int) -> list:
        return []

    def backlog(self) -> int:
        return 0

    def unfinished(self) -> list:
        return []

    def detach(self) -> None:
        self.detached += 1


def test_a_session_detaches_at_its_end_unless_the_mode_is_reused() -> None:
    """``ccprofd trace`` detaches when its target is gone; a mode prepared once and reused for
    several commands (bench/report_trace.py) must stay attached: detaching it made every run after
    the first one sampleless (the reduced report's depth-100 recursion run lost its samples)."""
    gone = 2**22 + 1  # above pid_max's default: no such process
    for reuse, expected in ((False, 1), (True, 0)):
        stub = _ModeStub()
        session = Session(stub, attached=gone, detach_at_end=not reuse)  # type: ignore[arg-type]
        assert list(session.batches()) == []
        assert stub.detached == expected
