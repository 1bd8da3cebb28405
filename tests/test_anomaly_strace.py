"""The evaluation of issue 7 on a real program, with contexts from ``strace -f -k`` (independent of
ccprofd's tracer): learn on the normal commands of ``anomaly_cmds``; detection must report exactly
the hidden command's syscalls and nothing for other runs of normal commands.

The expected alert contexts are written by hand from the program's source (see the comment at the top
of tests/programs/anomaly_cmds.c), not taken from ccprofd's output.
"""

from __future__ import annotations

from typing import Any

import pytest
from anomaly_strace import strace_samples
from conftest import require_tool
from programs.build import build

from ccprofd.anomaly.detector import Detector, DetectorOptions
from ccprofd.anomaly.model import Learner, ModelSet

SYSCALLS = ["openat", "read", "write", "execve"]
HIDDEN_OPEN = ["main", "run_script", "dispatch", "cmd_debug", "audit_dump", "raw_open"]
HIDDEN_READ = ["main", "run_script", "dispatch", "cmd_debug", "audit_dump", "read_chunk"]
HIDDEN_WRITES = [["main", "run_script", "dispatch", "cmd_debug", "audit_dump", "emit"],
                 ["main", "run_script", "dispatch", "cmd_debug", "emit"]]
HIDDEN_EXEC = ["main", "run_script", "dispatch", "cmd_shell", "escape"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("anomaly-files")
    out = []
    for i, text in enumerate(["alpha\nbeta\n", "x" * 70000, "one line only\n", "a\nb\nc\nd\n"]):
        p = d / f"f{i}.txt"
        p.write_text(text)
        out.append(str(p))
    return out


def in_main(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples taken inside main (the tracer's scope: it starts tracking at the target's exec)."""
    return [s for s in samples if s["frames"]]


def chains(alerts: list[Any]) -> list[tuple[str, tuple[str, ...]]]:
    return sorted((a.syscall, tuple(f["function"] for f in a.frames)) for a in alerts)


@pytest.mark.parametrize("variant", [{"opt": "O0"}, {"opt": "O2", "pie": False}])
def test_hidden_command_found_and_nothing_else(files: list[str], variant: dict[str, Any]) -> None:
    require_tool("strace")
    prog = str(build("anomaly_cmds", **variant))
    f0, f1, f2, f3 = files
    training = [["cat", f0, "count", f1], ["head", f2, "cat", f3], ["count", f0, "head", f1],
                ["cat", f1], ["run", "/bin/true"]]
    models = ModelSet()
    build_id = None
    for cmds in training:
        samples, rc = strace_samples([prog, *cmds], syscalls=",".join(SYSCALLS))
        assert rc == 0
        build_id = next(s["frames"][0]["build_id"] for s in in_main(samples))
        learner = Learner(models.target(build_id, prog), syscalls=SYSCALLS)
        for s in in_main(samples):
            learner.observe(s)
    assert build_id is not None
    model = models.targets[build_id]
    opts = DetectorOptions(alert_interval_seconds=0)

    # Normal commands, another order, other arguments: no alert.
    for cmds in (["head", f3, "count", f2, "cat", f2], ["count", f3, "cat", f0, "head", f0, "cat", f1]):
        samples, rc = strace_samples([prog, *cmds], syscalls=",".join(SYSCALLS))
        assert rc == 0
        det = Detector(model, opts)
        alerts = [a for s in in_main(samples) for a in det.check(s)]
        assert alerts == [], chains(alerts)

    # The hidden command among normal ones: exactly its own syscalls.
    samples, rc = strace_samples([prog, "cat", f0, "debug", f0, "count", f1], syscalls=",".join(SYSCALLS))
    assert rc == 0
    det = Detector(model, opts)
    alerts = [a for s in in_main(samples) for a in det.check(s)]
    assert set(chains(alerts)) == {("openat", tuple(HIDDEN_OPEN)), ("read", tuple(HIDDEN_READ)),
                                   *(("write", tuple(w)) for w in HIDDEN_WRITES)}
    [open_alert] = [a for a in alerts if a.syscall == "openat"]
    assert open_alert.args == {"path": f0}
    # Its nearest known openat contexts share main > run_script > dispatch.
    assert open_alert.nearest and all(n["common_prefix"] == 3 for n in open_alert.nearest)
    assert {n["frames"][3]["function"] for n in open_alert.nearest} <= {"cmd_cat", "cmd_count", "cmd_head"}

    # An execve from a context never seen in training.
    samples, rc = strace_samples([prog, "cat", f0, "shell", "/bin/echo"], syscalls=",".join(SYSCALLS))
    assert rc == 0
    det = Detector(model, opts)
    alerts = [a for s in in_main(samples) for a in det.check(s)]
    assert chains(alerts) == [("execve", tuple(HIDDEN_EXEC))]
    assert alerts[0].args == {"filename": "/bin/echo"}
