"""Shared test fixtures.

The BPF rule: a test that needs BPF calls ``require_bpf()`` (or uses the ``bpf`` fixture).  Where BPF
is not usable it is skipped on a developer machine but *fails* when ``CI=true``, so a missing set-up
step can never hide behind skips in CI.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(reason: str) -> None:
    """Skip locally, fail in CI (CI=true): used for every prerequisite of a real-BPF test."""
    if IN_CI:
        pytest.fail(f"CI=true and a BPF prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def bpf_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "not root: BPF needs CAP_BPF/CAP_PERFMON"
    try:
        import bcc  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"bcc not importable: {exc}"
    if not any(os.path.isdir(f"{d}/events") for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")):
        return "tracefs not mounted"
    return None


def require_bpf() -> None:
    reason = bpf_unavailable_reason()
    if reason:
        skip_or_fail(reason)


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} not installed")
    assert path is not None
    return path


@pytest.fixture
def bpf() -> None:
    """Use as a fixture argument in every test that loads BPF programs."""
    require_bpf()


@pytest.fixture
def workdir() -> Iterator[str]:
    """A fresh directory with a short path (a daemon's Unix sockets live there: 107 bytes at most)."""
    d = tempfile.mkdtemp(prefix="ccp", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)
