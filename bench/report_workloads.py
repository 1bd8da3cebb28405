"""The workloads of the evaluation report: what each one runs, with inputs generated into a work
directory (deterministic: fixed seeds, ``PYTHONHASHSEED=0``), in a full and a reduced size.

A workload traces one binary (``argv[0]`` of every invocation); several invocations (the recursion
test program at several depths) are run back to back under one prepared tracer and pooled.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    name: str
    binary: str
    invocations: list[list[str]]
    description: str
    scope: str | None  # --scope regex; None: chosen from the instrumented run (report.pick_scope)
    recursive: bool  # counts toward the "Valence <= 0.5 x PCCE" target
    stdin: str | None = None
    env: dict[str, str] | None = None
    group: str = "system"  # "system" | "test program"
    notes: list[str] = field(default_factory=list)


BASH_SCRIPT = """\
f() {{ if (( $1 > 0 )); then f $(( $1 - 1 )); else : > /dev/null; fi; }}
for (( i = 0; i < {reps}; i++ )); do f $(( i % {depth} )); done
"""

PY_RECURSIVE = """\
import os
import sys

sys.setrecursionlimit(20000)


def down(n):
    # Python-to-Python recursion: CPython 3.11 runs it inside one C frame of the eval loop.
    if n == 0:
        return os.getppid()
    return down(n - 1)


def via_c(n):
    # Recursion through a C builtin (map, sum): every level is a chain of C frames.
    if n == 0:
        return os.getppid()
    return sum(map(via_c, [n - 1]))


for i in range({reps}):
    down(i % {depth})
    via_c(i % {depth})
"""

PY_JSON = """\
import json
import os


def nest(d):
    return {{"k": [nest(d - 1), d, "x" * d]}} if d else "leaf"


obj = nest({depth})
fd = os.open(os.devnull, os.O_WRONLY)
for i in range({reps}):
    text = json.dumps(obj)
    obj = json.loads(text)
    if i % 10 == 0:
        os.write(fd, text.encode())
"""

LUA_SCRIPT = """\
local function f(n)
  if n == 0 then
    local h = io.open("/dev/null", "w")
    h:write("x")
    h:close()
    return 0
  end
  local ok, v = pcall(f, n - 1)
  return v + 1
end
for i = 1, {reps} do f(i % {depth}) end
"""

SQL_SCRIPT = """\
CREATE TABLE t(id INTEGER PRIMARY KEY, grp INTEGER, name TEXT, v REAL);
BEGIN;
WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {rows})
INSERT INTO t(grp, name, v) SELECT i % 37, 'name' || i, i * 0.5 FROM c;
COMMIT;
CREATE INDEX t_grp ON t(grp);
{queries}
"""
SQL_QUERY = "SELECT grp, count(*), sum(v), max(name) FROM t WHERE id % {k} = 0 GROUP BY grp ORDER BY grp;\n"


def _text_file(path: Path, size: int, seed: int = 8) -> None:
    """Compressible but not trivial text (words from a small vocabulary, random order)."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10**6):06d}" for _ in range(4096)]
    out: list[str] = []
    n = 0
    while n < size:
        line = " ".join(rng.choice(words) for _ in range(12)) + "\n"
        out.append(line)
        n += len(line)
    path.write_text("".join(out)[:size])


def test_program(name: str) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from programs.build import build
    finally:
        sys.path.pop(0)
    return str(build(name, opt="O2", pie=True))


REDUCED = ("bash-recursive", "test:recursion")


def workloads(work: Path, reduced: bool) -> list[Workload]:
    """Generate the inputs into ``work`` and describe every workload whose binary exists (reduced:
    only the ``REDUCED`` ones, on small inputs)."""
    work.mkdir(parents=True, exist_ok=True)
    r = reduced
    py_env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    out: list[Workload] = []

    bash = shutil.which("bash") or "/bin/bash"
    reps, depth = (30, 10) if r else (100, 15)
    (work / "rec.sh").write_text(BASH_SCRIPT.format(reps=reps, depth=depth))
    out.append(
        Workload(
            "bash-recursive",
            bash,
            [[bash, str(work / "rec.sh")]],
            f"recursive shell function, {reps} calls of depth < {depth}, a redirection at the bottom",
            scope=None,
            recursive=True,
        )
    )

    py = "/usr/bin/python3.11"
    if os.path.exists(py):
        reps, depth = (20, 10) if r else (30, 20)
        (work / "rec.py").write_text(PY_RECURSIVE.format(reps=reps, depth=depth))
        out.append(
            Workload(
                "python-recursive",
                py,
                [[py, "-S", str(work / "rec.py")]],
                f"recursive script: Python recursion and recursion through map/sum, {reps} x "
                f"depth < {depth}, getppid() at the bottom",
                scope=r"^_PyEval_EvalFrameDefault$",
                recursive=True,
                env=py_env,
            )
        )
        reps, depth = (100, 8) if r else (100, 12)
        (work / "json_rt.py").write_text(PY_JSON.format(reps=reps, depth=depth))
        out.append(
            Workload(
                "python-json",
                py,
                [[py, "-S", str(work / "json_rt.py")]],
                f"{reps} json.dumps/json.loads round trips of a depth-{depth} structure",
                scope=None,
                recursive=False,
                env=py_env,
            )
        )

    size = 256 * 1024 if r else 4 * 2**20
    data = work / f"text-{size}.txt"
    if not data.exists():
        _text_file(data, size)
    gz = shutil.which("gzip")
    if gz:
        out.append(
            Workload(
                "gzip",
                gz,
                [[gz, "-c", "-6", str(data)]],
                f"gzip -6 of {size // 1024} KiB of text",
                scope=None,
                recursive=False,
            )
        )
    xzb = shutil.which("xz")
    if xzb:
        xsize = size // 4
        xdata = work / f"text-{xsize}.txt"
        if not xdata.exists():
            _text_file(xdata, xsize, seed=9)
        out.append(
            Workload(
                "xz",
                xzb,
                [[xzb, "-T1", "-c", "-6", str(xdata)]],
                f"xz -T1 -6 of {xsize // 1024} KiB of text (the work is in liblzma)",
                scope=None,
                recursive=False,
            )
        )
    sq = shutil.which("sqlite3")
    if sq:
        rows, nq = (2000, 5) if r else (20000, 60)
        queries = "".join(SQL_QUERY.format(k=k) for k in range(1, nq + 1))
        (work / "q.sql").write_text(SQL_SCRIPT.format(rows=rows, queries=queries))
        out.append(
            Workload(
                "sqlite3",
                sq,
                [[sq, ":memory:"]],
                f"sqlite3 CLI: {rows} inserts, an index, {nq} GROUP BY queries",
                scope=None,
                recursive=False,
                stdin=str(work / "q.sql"),
            )
        )
    lua = shutil.which("lua5.4")
    if lua:
        reps, depth = (20, 10) if r else (200, 30)
        (work / "rec.lua").write_text(LUA_SCRIPT.format(reps=reps, depth=depth))
        out.append(
            Workload(
                "lua-recursive",
                lua,
                [[lua, str(work / "rec.lua")]],
                f"recursive Lua function through pcall, {reps} x depth < {depth}, a file write at the bottom",
                scope=None,
                recursive=True,
            )
        )

    rec = test_program("recursion")
    depths = ["10", "100"] if r else ["10", "100", "1000", "3000"]
    out.append(
        Workload(
            "test:recursion",
            rec,
            [[rec, d] for d in depths],
            "direct, mutual and 3-function recursion at depths " + ", ".join(depths),
            scope=None,
            recursive=True,
            group="test program",
        )
    )
    if not r:
        exc = test_program("exceptions")
        out.append(
            Workload(
                "test:exceptions",
                exc,
                [[exc, "300"]],
                "C++ exception thrown through 300 frames",
                scope=None,
                recursive=True,
                group="test program",
            )
        )
        lj = test_program("longjmp")
        out.append(
            Workload(
                "test:longjmp",
                lj,
                [[lj, "300"]],
                "longjmp out of a 300-deep recursion",
                scope=None,
                recursive=True,
                group="test program",
            )
        )
    return [w for w in out if w.name in REDUCED] if reduced else out


def table1_binaries(reduced: bool) -> list[tuple[str, str]]:
    """(label, path) of every binary of Table 1 that exists here."""
    names = (
        ["/usr/bin/gzip"]
        if reduced
        else [
            "/usr/bin/python3.11",
            "/bin/bash",
            "/usr/bin/gzip",
            "/usr/bin/xz",
            "/usr/bin/sqlite3",
            "/usr/bin/lua5.4",
        ]
    )
    out = [(Path(p).name, p) for p in names if os.path.exists(p)]
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from programs.build import PROGRAMS
    finally:
        sys.path.pop(0)
    progs = ["recursion", "calls"] if reduced else sorted(PROGRAMS)
    out += [(f"test:{p}", test_program(p)) for p in progs]
    return out
