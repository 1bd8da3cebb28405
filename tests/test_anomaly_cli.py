"""``ccprofd learn/detect/model`` on JSONL samples (from ``strace -k`` of anomaly_cmds, see
anomaly_strace.py): exit codes, one JSON alert per line, show/remove/allow/merge, and a corrupt
model file that is reported and left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from anomaly_strace import strace_samples
from conftest import require_tool
from programs.build import build

SYSCALLS = "openat,read,write"


def ccprofd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli",
                           *args], capture_output=True, text=True)


def write_jsonl(path: Path, samples: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples if s["frames"]))
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    require_tool("strace")
    d = tmp_path_factory.mktemp("anomaly-cli")
    data = d / "data.txt"
    data.write_text("some\ntext\n")
    prog = str(build("anomaly_cmds", opt="O2"))
    out = {}
    runs = {"train1": ["cat", str(data), "count", str(data)], "train2": ["head", str(data)],
            "normal": ["head", str(data), "cat", str(data)], "hidden": ["debug", str(data)]}
    for name, cmds in runs.items():
        samples, rc = strace_samples([prog, *cmds], syscalls=SYSCALLS)
        assert rc == 0
        out[name] = write_jsonl(d / f"{name}.jsonl", samples)
    out["dir"] = str(d)
    return out


def test_learn_detect_show_edit(traces: dict[str, str], tmp_path: Path) -> None:
    model = str(tmp_path / "m.json")
    for t in ("train1", "train2"):
        r = ccprofd("learn", "--model", model, "--syscalls", SYSCALLS, "--samples", traces[t])
        assert r.returncode == 0, r.stderr
    doc = json.loads(Path(model).read_text())
    [target] = doc["targets"]
    assert target["runs"] == 2 and target["syscalls"] == ["openat", "read", "write"]

    r = ccprofd("detect", "--model", model, "--samples", traces["normal"])
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")

    alerts_file = tmp_path / "alerts.jsonl"
    r = ccprofd("detect", "--model", model, "--samples", traces["hidden"], "--output", str(alerts_file))
    assert r.returncode == 0 and r.stderr == ""
    alerts = [json.loads(line) for line in alerts_file.read_text().splitlines()]
    assert {a["syscall"] for a in alerts} == {"openat", "read", "write"}
    assert all(a["kind"] == "unseen_context" and "cmd_debug" in [f["function"] for f in a["frames"]]
               for a in alerts)
    # Without --output the alerts go to standard error, one JSON object per line.
    r = ccprofd("detect", "--model", model, "--samples", traces["hidden"])
    assert r.stdout == ""
    assert [json.loads(x)["kind"] for x in r.stderr.splitlines()] == [a["kind"] for a in alerts]

    r = ccprofd("model", "show", model)
    assert r.returncode == 0
    assert "runs 2" in r.stdout and "open_file" in r.stdout and "cmd_debug" not in r.stdout
    n_contexts = len(target["contexts"])
    assert r.stdout.count("  [") == n_contexts

    # Allow the hidden openat by prefix: it is no longer reported; its read/write still are.
    r = ccprofd("model", "allow", model, "--syscall", "openat",
                "--prefix", "main,run_script,dispatch,cmd_debug")
    assert r.returncode == 0, r.stderr
    r = ccprofd("detect", "--model", model, "--samples", traces["hidden"])
    assert {json.loads(x)["syscall"] for x in r.stderr.splitlines()} == {"read", "write"}

    # Remove the openat context of cmd_head: head's openat becomes unseen.
    doc = json.loads(Path(model).read_text())
    ids = [i for i, c in enumerate(doc["targets"][0]["contexts"])
           if c["syscall"] == "openat" and any(f[1] == "cmd_head" for f in c["frames"])]
    assert len(ids) == 1
    r = ccprofd("model", "remove", model, "--id", str(ids[0]))
    assert r.returncode == 0, r.stderr
    r = ccprofd("detect", "--model", model, "--samples", traces["normal"])
    [alert] = [json.loads(x) for x in r.stderr.splitlines()]
    assert alert["syscall"] == "openat" and alert["frames"][3]["function"] == "cmd_head"

    # Merge: counts add up.
    merged = str(tmp_path / "merged.json")
    assert ccprofd("model", "merge", merged, model, model).returncode == 0
    assert json.loads(Path(merged).read_text())["targets"][0]["runs"] == 4


def test_bad_input(traces: dict[str, str], tmp_path: Path) -> None:
    model = tmp_path / "m.json"
    model.write_text("{torn")
    r = ccprofd("learn", "--model", str(model), "--samples", traces["train1"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "corrupt" in r.stderr
    assert model.read_text() == "{torn"
    r = ccprofd("detect", "--model", str(model), "--samples", traces["train1"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = ccprofd("detect", "--model", str(tmp_path / "missing.json"), "--samples", traces["train1"])
    assert r.returncode == 2 and "does not exist" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"pid": 1}\n')
    r = ccprofd("learn", "--model", str(tmp_path / "new.json"), "--samples", str(bad))
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr
    r = ccprofd("learn", "--model", str(tmp_path / "new.json"))
    assert r.returncode == 2
    # A model of another build: reported, not applied.
    good = tmp_path / "g.json"
    assert ccprofd("learn", "--model", str(good), "--samples", traces["train1"]).returncode == 0
    doc = json.loads(good.read_text())
    doc["targets"][0]["build_id"] = "00" * 20
    good.write_text(json.dumps(doc))
    r = ccprofd("detect", "--model", str(good), "--samples", traces["train1"])
    assert r.returncode == 2 and "learn again" in r.stderr and r.stderr.count("\n") == 1
