"""``ccprofd analyze`` on real system binaries, against objdump counts (the issue's "Done when").

System binaries come stripped, so the comparison is limited to what binutils shows without
symbols: the counts of ``call rel32`` (all, and into the PLT), of indirect calls and jumps, the
build-id and PIE-ness; and every function ``.eh_frame`` reveals (minus fragments, by the CFI rule
of :func:`binutils_oracle.cfi_fragment_starts`) and every defined ``.dynsym`` function must be a node.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from binutils_oracle import cfi_fragment_starts, oracle

SYSTEM_BINARIES = [p for p in ("/usr/bin/python3.11", "/usr/bin/bash", "/usr/bin/gzip")
                   if os.path.exists(p)]


def _ccprofd() -> str:
    return str(pathlib.Path(sys.executable).parent / "ccprofd")


@pytest.mark.parametrize("path", SYSTEM_BINARIES)
def test_system_binary_counts_agree_with_objdump(path: str) -> None:
    o = oracle(path)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CCPROFD_CACHE_DIR=cache, XDG_CACHE_HOME=cache, HOME=cache)
        proc = subprocess.run([_ccprofd(), "analyze", "--json", path], capture_output=True, text=True,
                              env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    got = {k: data.get(k) for k in ("build_id", "pie", "direct_calls", "plt_calls", "indirect_calls")}
    want = {"build_id": o.build_id, "pie": o.pie, "direct_calls": o.direct_calls, "plt_calls": o.plt_calls,
            "indirect_calls": o.indirect_calls}
    assert got == want
    if "indirect_jumps" in data:
        assert data["indirect_jumps"] == o.indirect_jumps


@pytest.mark.parametrize("path", SYSTEM_BINARIES)
def test_system_binary_functions_include_fdes_and_dynsym(path: str) -> None:
    from ccprofd.callgraph import analyze_binary

    o = oracle(path)
    fragments = cfi_fragment_starts(path)
    want = o.fde_or_dynamic_functions() - fragments
    cg = analyze_binary(path, use_cache=False)
    nodes = {n for n, k in cg.graph.nodes(data="kind") if k == "function"}
    missing = sorted(want - nodes)
    assert not missing, f"{len(missing)} functions missing, e.g. {[hex(a) for a in missing[:10]]}"
    folded = sorted(nodes & fragments)
    assert not folded, f"fragments reported as functions: {[hex(a) for a in folded[:10]]}"
