"""The reduced CI run of the real-service anomaly benchmark (issue 14, bench/services_anomaly.py):
a real ``redis-server`` learned by ``ccprofd learn -- redis-server ...`` over a few
``redis-benchmark`` mixes, then run under ``ccprofd detect`` and attacked the classic way
(``CONFIG SET dir`` + ``CONFIG SET dbfilename`` + ``SAVE``: an RDB file written where the attacker
chose).  The alert must carry the chain that reached the file: the expected functions are redis's
own command handlers (``SAVE`` is ``saveCommand``, which calls ``rdbSave``, which opens the temp
file), and each frame's call site is checked against the function's extent in ``nm -DS`` of the
binary, not against anything ccprofd says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from ports import free_port

BENCH_MIXES = (["-t", "set,get,incr", "-n", "2000", "-c", "4"],
               ["-t", "lpush,lrange_100,lpop", "-n", "1000", "-c", "10", "-d", "512"],
               ["-t", "sadd,hset,spop,ping_inline", "-n", "1500", "-c", "2", "-P", "4"])


def nm_extents(binary: str) -> dict[str, tuple[int, int]]:
    """Defined functions of ``binary`` from binutils: name -> [start, end)."""
    out = subprocess.run(["nm", "-DS", "--defined-only", binary], capture_output=True, text=True,
                         check=True).stdout
    extents: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "Tt":
            extents[parts[3]] = (int(parts[0], 16), int(parts[0], 16) + int(parts[1], 16))
    return extents


class Served:
    """redis-server as the command of ``ccprofd learn|detect``, on a loopback port."""

    def __init__(self, verb: list[str], data: Path) -> None:
        self.port = free_port()
        redis = require_tool("redis-server")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli", *verb, "--", redis, "--port", str(self.port), "--bind",
             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data), "--daemonize", "no",
             "--logfile", str(data / "redis.log"), "--enable-protected-configs", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600  # only to end a hung start: analysis is slow on a loaded VM
        while self.cli("ping") != "PONG":
            assert self.proc.poll() is None, f"ccprofd {verb[0]} exited: {self.proc.stderr.read()[-2000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "redis under ccprofd never answered"
            time.sleep(0.3)

    def cli(self, *cmd: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(self.port), *cmd], capture_output=True,
                              text=True).stdout.strip()

    def bench(self, args: list[str]) -> None:
        subprocess.run(["redis-benchmark", "-p", str(self.port), "-q", *args], capture_output=True,
                       check=True)

    def shutdown(self) -> str:
        self.cli("shutdown", "nosave")
        _, err = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, err[-2000:]
        return err


def frame_names(a: dict[str, Any]) -> list[str]:
    return [str(f.get("function")) for f in a["frames"]]


@pytest.mark.bpf
def test_redis_config_set_dir_save_is_alerted_with_the_chain_that_reached_it(tmp_path: Path) -> None:
    require_bpf()
    for tool in ("redis-server", "redis-cli", "redis-benchmark", "nm"):
        require_tool(tool)
    binary = os.path.realpath(require_tool("redis-server"))  # Debian: a link to redis-check-rdb
    extents = nm_extents(binary)
    assert {"saveCommand", "rdbSave", "configSetCommand"} <= extents.keys()
    data = tmp_path / "data"
    data.mkdir()
    model = tmp_path / "model.json"

    learning = Served(["learn", "--model", str(model)], data)
    for mix in BENCH_MIXES:
        learning.bench(mix)
    learning.shutdown()
    [target] = json.loads(model.read_text())["targets"]
    assert target["contexts"]

    # The same attack under each granularity that judges this model; "routines" accepts more
    # (docs/anomaly-routines.md), and must still see the attack with its chain.
    for granularity in ("exact", "routines"):
        alerts = attacked(model, data, tmp_path / granularity, granularity)
        # rdbSave opens "temp-<pid>.rdb" in the new dir (then renames it to the chosen name)
        opens = [a for a in alerts if a["syscall"] == "openat" and a.get("kind") == "unseen_context"
                 and str(a.get("args", {}).get("path", "")).endswith(".rdb")]
        assert opens, f"{granularity}: no alert for the RDB file's openat among {len(alerts)} alerts: " + \
            "; ".join(f"{a['syscall']} {frame_names(a)[-4:]}" for a in alerts[:10])
        for a in opens:
            names = frame_names(a)
            assert "saveCommand" in names and "rdbSave" in names, names
            assert names.index("saveCommand") < names.index("rdbSave"), names  # outermost first
            for f in a["frames"]:
                if f.get("function") in ("saveCommand", "rdbSave"):
                    lo, hi = extents[str(f["function"])]
                    assert lo <= int(f["call_site"], 16) < hi, (f, lo, hi)
        # and CONFIG SET dir's chdir, a syscall no training mix made from configSetCommand
        assert any("configSetCommand" in frame_names(a) for a in alerts), [a["syscall"] for a in alerts]


def attacked(model: Path, data: Path, work: Path, granularity: str) -> list[dict[str, Any]]:
    """redis under ``ccprofd detect --granularity G``: normal traffic, then CONFIG SET dir +
    dbfilename + SAVE; the alerts."""
    work.mkdir()
    evil = work / "evil"
    evil.mkdir()
    alerts_file = work / "alerts.jsonl"
    watched = Served(["detect", "--model", str(model), "--granularity", granularity, "--alert-interval", "0",
                      "--output", str(alerts_file)], data)
    watched.bench(["-t", "get,lpush", "-n", "1000", "-c", "4"])  # normal traffic first
    assert watched.cli("config", "set", "dir", str(evil)) == "OK"
    assert watched.cli("config", "set", "dbfilename", "authorized_keys") == "OK"
    assert watched.cli("save") == "OK"
    watched.shutdown()
    assert (evil / "authorized_keys").exists()  # detection only: the attack went through
    text = alerts_file.read_text() if alerts_file.exists() else ""
    return [json.loads(line) for line in text.splitlines()]
