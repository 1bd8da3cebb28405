"""The separate debug-file locator (ccprofd/elf/debugfile.py) against objects made with gcc and
objcopy in a temporary debug root: build-id path, .gnu_debuglink with its CRC, debuginfod."""

from __future__ import annotations

import http.server
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_tool, skip_or_fail

from ccprofd.elf.debugfile import DebugFileLocator, debuginfod_urls_from_env, file_crc32, read_ids

Split = tuple[Path, Path, str]

SRC = "static int helper(int x) { return x * 3; }\nint main(int c, char **v) { (void)v; return helper(c); }\n"


@pytest.fixture
def split(tmp_path: Path) -> tuple[Path, Path, str]:
    """(stripped program with a debuglink, its debug file, build-id), made by gcc and objcopy."""
    gcc, objcopy = require_tool("gcc"), require_tool("objcopy")
    src = tmp_path / "p.c"
    src.write_text(SRC)
    prog = tmp_path / "bin" / "prog"
    prog.parent.mkdir()
    subprocess.run([gcc, "-g", "-O1", "-Wl,--build-id", "-o", str(prog), str(src)], check=True)
    dbg = tmp_path / "prog.debug"
    subprocess.run([objcopy, "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run([objcopy, "--strip-all", f"--add-gnu-debuglink={dbg}", str(prog)], check=True)
    out = subprocess.run(["readelf", "-n", str(prog)], check=True, capture_output=True, text=True).stdout
    bid = next(line.split()[-1] for line in out.splitlines() if "Build ID" in line)
    return prog, dbg, bid


def test_read_ids_matches_readelf(split: Split) -> None:
    prog, dbg, bid = split
    ids = read_ids(str(prog))
    assert ids.build_id == bid
    assert ids.debuglink is not None and ids.debuglink.name == "prog.debug"
    # objcopy computed the CRC it wrote; ours must agree with it
    assert ids.debuglink.crc == file_crc32(str(dbg))
    assert read_ids(str(dbg)).build_id == bid


def test_build_id_path(tmp_path: Path, split: Split) -> None:
    prog, dbg, bid = split
    root = tmp_path / "root"
    target = root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.copy(dbg, target)
    os.unlink(dbg)  # so the debuglink cannot be what finds it
    assert DebugFileLocator(str(root)).find(str(prog)) == str(target)
    assert DebugFileLocator(str(root)).find(str(prog), bid) == str(target)


def test_build_id_path_with_another_build_id_is_rejected(tmp_path: Path, split: Split) -> None:
    prog, dbg, _ = split
    root = tmp_path / "root"
    other = "ab" + ("cd" * 19)
    target = root / ".build-id" / other[:2] / f"{other[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.copy(dbg, target)  # holds the build-id `bid`, not `other`
    os.unlink(dbg)
    assert DebugFileLocator(str(root)).find(str(prog), other) is None


@pytest.mark.parametrize("where", ["same", "dotdebug", "root"])
def test_debuglink_places(tmp_path: Path, split: Split, where: str) -> None:
    prog, dbg, _ = split
    root = tmp_path / "root"
    d = prog.parent
    dest = {"same": d / "prog.debug", "dotdebug": d / ".debug" / "prog.debug",
            "root": root / str(d).lstrip("/") / "prog.debug"}[where]
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(dbg, dest)
    assert DebugFileLocator(str(root)).find(str(prog)) == str(dest)


def test_debuglink_crc_mismatch_is_rejected(tmp_path: Path, split: Split) -> None:
    prog, dbg, _ = split
    dest = prog.parent / "prog.debug"
    data = bytearray(dbg.read_bytes())
    data[-1] ^= 0xFF  # same name, other contents: another build's debug file
    dest.write_bytes(bytes(data))
    os.unlink(dbg)
    assert DebugFileLocator(str(tmp_path / "root")).find(str(prog)) is None


class _Server:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.hits: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits.append(self.path)
                body = files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_for(split: Split) -> Iterator[_Server]:
    _, dbg, bid = split
    srv = _Server({f"/buildid/{bid}/debuginfo": dbg.read_bytes()})
    yield srv
    srv.close()


def test_debuginfod_fetches_and_caches(tmp_path: Path, split: Split, server_for: _Server) -> None:
    prog, dbg, bid = split
    want = dbg.read_bytes()
    os.unlink(dbg)
    cache = tmp_path / "cache"
    got = DebugFileLocator(str(tmp_path / "root"), [server_for.url], cache).find(str(prog))
    assert got == str(cache / "debuginfod" / bid / "debuginfo")
    assert Path(got).read_bytes() == want
    assert server_for.hits == [f"/buildid/{bid}/debuginfo"]
    # a new locator (a new trace) finds it in the cache without asking the server
    server_for.close()
    again = DebugFileLocator(str(tmp_path / "root"), [server_for.url], cache).find(str(prog))
    assert again == got and len(server_for.hits) == 1


def test_debuginfod_failure_is_a_warning(tmp_path: Path, split: Split,
                                         caplog: pytest.LogCaptureFixture) -> None:
    prog, dbg, _ = split
    os.unlink(dbg)
    srv = _Server({})  # knows no build-id: 404
    try:
        loc = DebugFileLocator(str(tmp_path / "root"), [srv.url, "http://127.0.0.1:1"], tmp_path / "c")
        with caplog.at_level(logging.WARNING, logger="ccprofd"):
            assert loc.find(str(prog)) is None
    finally:
        srv.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in m and "debuginfod" in m for m in lines)
    assert not list((tmp_path / "c").rglob("debuginfo"))


def test_debuginfod_is_off_unless_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEBUGINFOD_URLS", "https://debuginfod.example https://b.example")
    monkeypatch.delenv("CCPROFD_DEBUGINFOD", raising=False)
    assert debuginfod_urls_from_env() == []
    monkeypatch.setenv("CCPROFD_DEBUGINFOD", "1")
    assert debuginfod_urls_from_env() == ["https://debuginfod.example", "https://b.example"]


def test_system_libc_debug_file() -> None:
    """libc6-dbg (scripts/setup.sh installs it): libc's debug file by its build-id."""
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    bid = read_ids(libc).build_id
    assert bid is not None
    got = DebugFileLocator().find(libc)
    if got is None:
        skip_or_fail("libc6-dbg not installed")
    assert got == f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"


def test_read_ids_of_malformed_objects(tmp_path: Path, split: Split) -> None:
    """Seeded overwrites of the ELF header, section headers and notes: read_ids answers (maybe
    None), never raises (a damaged debug file or module must not end a trace)."""
    import random
    import struct

    _, dbg, _ = split
    data = dbg.read_bytes()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    regions = [(0, 64), (shoff, len(data) - shoff)]
    rng = random.Random(5)
    for i in range(300):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            lo, size = rng.choice(regions)
            buf[lo + rng.randrange(size)] = rng.randrange(256)
        path = tmp_path / f"m{i % 4}"
        path.write_bytes(bytes(buf[: rng.randrange(len(buf))] if i % 10 == 0 else buf))
        read_ids(str(path))
        DebugFileLocator(str(tmp_path / "root")).find(str(path))
