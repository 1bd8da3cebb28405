"""Compile once, load many times: the compiled form of a BPF C translation unit, and its cache.

Compiling BPF C (clang inside libbcc) costs seconds and keeps libbcc + LLVM mapped in the process
that does it.  A :class:`CompiledObject` is everything a raw ``bpf(2)`` loader
(:mod:`ccprofd.kbpf.rawmodule`) needs instead: per function its instructions as the compiler left
them *before* loading, with each map reference recorded as (instruction index, map name) and its
immediate zeroed (the compiling process's map fds mean nothing elsewhere); per map its kernel
parameters and bcc's description of the C key/value types (to rebuild ctypes types with field
names); the license.  It is a plain value, serialised as JSON.

:func:`compile_cached` returns the object for (source, cflags) from the cache directory, or has
a subprocess (:mod:`ccprofd.kbpf.compile_worker`) compile it — so libbcc never maps into the caller —
and stores it atomically.  The cache key covers everything the compiled form depends on: the
source, the cflags, this format's version, the running kernel (tracepoint formats, headers) and
the identity of libbcc and of the kernel headers it compiles against.  An unreadable or corrupt
cache file is compiled again, never an error.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccprofd.kbpf.errors import BPFError
from ccprofd.persist.atomicfile import atomic_write_bytes

FORMAT_VERSION = 1
ENV_CACHE_DIR = "CCPROFD_BPF_CACHE_DIR"
ENV_PREBUILT_DIR = "CCPROFD_BPF_PREBUILT_DIR"
DEFAULT_PREBUILT_DIR = "/var/cache/ccprofd/bpf-prebuilt"
MAX_CACHED = 256  # objects kept per cache directory (~120 kB each for the unwinder); least recent go
LIBBCC_NAMES = ("libbcc.so.0",)
_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64",
             "/lib", "/usr/local/lib", "/usr/local/lib64")

# ld_imm64 with a map reference: BPF_PSEUDO_MAP_FD (imm = map fd) or BPF_PSEUDO_MAP_VALUE
# (imm = map fd, next imm = offset into the value)
LD_IMM64 = 0x18
PSEUDO_MAP_FD = 1
PSEUDO_MAP_VALUE = 2


@dataclass(frozen=True, slots=True)
class MapSpec:
    """One map as BPF_MAP_CREATE needs it, plus bcc's JSON type descriptions of key and value
    (None where the map has no key, e.g. queues and ring buffers)."""

    name: str
    map_type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: Any
    leaf_desc: Any


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One function's instructions with map immediates zeroed; ``relocations`` lists
    (index of the ld_imm64, name of the map it loads)."""

    name: str
    insns: bytes
    relocations: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class CompiledObject:
    license: str
    maps: tuple[MapSpec, ...]
    functions: tuple[FunctionSpec, ...]

    def function(self, name: str) -> FunctionSpec:
        for fn in self.functions:
            if fn.name == name:
                return fn
        raise BPFError(f"no compiled BPF function {name}")

    def map_spec(self, name: str) -> MapSpec:
        for m in self.maps:
            if m.name == name:
                return m
        raise BPFError(f"no BPF map {name}")

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_VERSION,
            "license": self.license,
            "maps": [{"name": m.name, "type": m.map_type, "key_size": m.key_size, "value_size": m.value_size,
                      "max_entries": m.max_entries, "flags": m.flags, "key_desc": m.key_desc,
                      "leaf_desc": m.leaf_desc} for m in self.maps],
            "functions": [{"name": f.name, "insns": base64.b64encode(f.insns).decode(),
                           "relocations": [list(r) for r in f.relocations]} for f in self.functions],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CompiledObject:
        """Parse :meth:`to_json` output; ValueError on anything malformed (a corrupt cache file)."""
        try:
            doc = json.loads(data)
            if doc["format"] != FORMAT_VERSION:
                raise ValueError(f"format {doc['format']}, not {FORMAT_VERSION}")
            maps = tuple(MapSpec(str(m["name"]), int(m["type"]), int(m["key_size"]), int(m["value_size"]),
                                 int(m["max_entries"]), int(m["flags"]), m["key_desc"], m["leaf_desc"])
                         for m in doc["maps"])
            funcs = []
            names = {m.name for m in maps}
            for f in doc["functions"]:
                insns = base64.b64decode(f["insns"], validate=True)
                relocs = tuple((int(i), str(n)) for i, n in f["relocations"])
                n_insns = len(insns) // 8
                if len(insns) % 8 or any(not 0 <= i < n_insns - 1 or n not in names for i, n in relocs):
                    raise ValueError(f"function {f['name']}: bad instructions or relocations")
                funcs.append(FunctionSpec(str(f["name"]), insns, relocs))
            return cls(str(doc["license"]), maps, tuple(funcs))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed compiled BPF object: {exc}") from None


def split_relocations(insns: bytes, fd_names: dict[int, str]) -> tuple[bytes, tuple[tuple[int, str], ...]]:
    """``insns`` as a compiler left them in its own process (map ld_imm64 immediates = that process's
    map fds) -> (instructions with those immediates zeroed, relocations).  ``fd_names`` maps the
    compiling process's map fds to map names."""
    out = bytearray(insns)
    relocs: list[tuple[int, str]] = []
    n = len(insns) // 8
    i = 0
    while i < n:
        code, regs = out[i * 8], out[i * 8 + 1]
        if code == LD_IMM64:
            if regs >> 4 in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE):
                fd = int.from_bytes(out[i * 8 + 4:i * 8 + 8], "little", signed=True)
                if fd not in fd_names:
                    raise BPFError(f"instruction {i} loads map fd {fd}, which is no map of this module")
                relocs.append((i, fd_names[fd]))
                out[i * 8 + 4:i * 8 + 8] = b"\0\0\0\0"
            i += 2  # ld_imm64 spans two instruction slots
        else:
            i += 1
    return bytes(out), tuple(relocs)


def apply_relocations(fn: FunctionSpec, map_fds: dict[str, int]) -> bytes:
    """``fn``'s instructions with each map reference pointing at ``map_fds[name]``."""
    out = bytearray(fn.insns)
    for i, name in fn.relocations:
        out[i * 8 + 4:i * 8 + 8] = map_fds[name].to_bytes(4, "little", signed=True)
    return bytes(out)


# ------------------------------------------------------------------------------------------ cache
def default_cache_dir() -> Path:
    """``$CCPROFD_BPF_CACHE_DIR``, else ``bpf/`` under the analysis cache's root."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    from ccprofd.persist.cache import default_cache_dir as analysis_root

    return analysis_root() / "bpf"


def cache_dir_under(analysis_cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The object cache inside an analysis cache directory (``<dir>/bpf``; None: the default), so a
    daemon keeps compiled objects under its state directory with its analyses."""
    return Path(analysis_cache_dir) / "bpf" if analysis_cache_dir is not None else None


def _stat_identity(path: str) -> str:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return f"{path}:absent"
    return f"{real}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def libbcc_identity() -> str:
    """Which libbcc would compile (found the way the dynamic loader would, without loading it)."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(_LIB_DIRS)
    for d in dirs:
        for name in LIBBCC_NAMES:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return _stat_identity(path)
    return "libbcc:absent"


def environment_identity() -> str:
    """Everything outside the source the compiled form depends on: kernel and compiler identity."""
    rel = os.uname().release
    try:
        with open("/proc/sys/kernel/version", encoding="ascii") as fh:
            version = fh.read().strip()
    except OSError:
        version = ""
    headers = [_stat_identity(f"/lib/modules/{rel}/{d}") for d in ("build", "source")]
    return "\n".join([rel, version, libbcc_identity(), *headers, kallsyms_identity()])


def kallsyms_identity() -> str:
    """Whether ``/proc/kallsyms`` lists symbols: bcc looks the ``bpf_probe_read_{user,kernel}``
    helpers up there and, when it cannot (systemd's ``ProtectKernelTunables=yes`` hides the file),
    compiles the legacy ``bpf_probe_read``/``bpf_probe_read_str`` instead: another object."""
    try:
        with open("/proc/kallsyms", "rb") as fh:
            return "kallsyms:listed" if fh.readline() else "kallsyms:empty"
    except OSError:
        return "kallsyms:unreadable"


def cache_key(text: str, cflags: tuple[str, ...] | list[str], environment: str | None = None) -> str:
    h = hashlib.sha256()
    for part in (f"ccprofd-bpf-object-v{FORMAT_VERSION}", text, "\0".join(cflags),
                 environment if environment is not None else environment_identity()):
        h.update(part.encode())
        h.update(b"\0\1\0")
    return h.hexdigest()


def cache_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.v{FORMAT_VERSION}.json"


def load_cached(path: Path) -> CompiledObject | None:
    """The object stored at ``path``; None when absent, unreadable or corrupt.  A hit renews the
    file's mtime, the recency :func:`prune` keeps by."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        obj = CompiledObject.from_json(data)
    except ValueError:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)
    return obj


def store(path: Path, obj: CompiledObject, *, keep: int = MAX_CACHED) -> None:
    """Write ``obj`` atomically, then :func:`prune`; an unwritable cache only costs the next start a
    compile."""
    with contextlib.suppress(OSError):
        atomic_write_bytes(path, obj.to_json())
        prune(path.parent, keep)


def prune(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` most recently used objects (every distinct source — each target's
    encoding sizes, each kernel — adds one, so the directory is bounded)."""
    files = []
    for p in directory.glob(f"*.v{FORMAT_VERSION}.json"):
        with contextlib.suppress(OSError):
            files.append((p.stat().st_mtime_ns, p))
    files.sort(reverse=True)
    for _, p in files[keep:]:
        with contextlib.suppress(OSError):
            p.unlink()


def compile_in_subprocess(text: str, cflags: tuple[str, ...] | list[str]) -> CompiledObject:
    """Run :mod:`ccprofd.kbpf.compile_worker` on (text, cflags): libbcc and LLVM live and die in that
    process.  Its failures come back as the same one-line :class:`BPFError` an in-process compile
    raises."""
    request = json.dumps({"text": text, "cflags": list(cflags)}).encode()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run([sys.executable, "-m", "ccprofd.kbpf.compile_worker"], input=request,
                              capture_output=True, env=env, check=False)
    except OSError as exc:
        raise BPFError(f"cannot start the BPF compiler process: {exc.strerror}") from None
    if proc.returncode == 0:
        try:
            return CompiledObject.from_json(proc.stdout)
        except ValueError as exc:
            raise BPFError(f"BPF compiler process returned a bad object: {exc}") from None
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode == 1 and lines:
        raise BPFError(lines[-1])
    tail = [ln for ln in proc.stderr.decode(errors="replace").splitlines() if ln.strip()][-1:]
    raise BPFError(f"BPF compiler process failed (exit {proc.returncode})" + (f": {tail[0]}" if tail else ""))


def prebuilt_dir() -> Path | None:
    """Where set-up leaves compiled objects (``scripts/setup.sh`` traces a small program once, so a
    first trace of another small program finds its object without clang): ``$CCPROFD_BPF_PREBUILT_DIR``
    (empty: none), else :data:`DEFAULT_PREBUILT_DIR`.  Read only; a hit is copied into the cache."""
    env = os.environ.get(ENV_PREBUILT_DIR)
    if env is not None:
        return Path(env) if env else None
    return Path(DEFAULT_PREBUILT_DIR)


def compile_cached(text: str, cflags: tuple[str, ...] | list[str] = (), *,
                   cache_dir: str | os.PathLike[str] | None = None) -> CompiledObject:
    """The compiled object of (``text``, ``cflags``): from the cache, else from the objects built at
    set-up (:func:`prebuilt_dir`), else compiled in a subprocess; cached."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(text, tuple(cflags))
    path = cache_path(directory, key)
    obj = load_cached(path)
    if obj is None:
        pre = prebuilt_dir()
        if pre is not None and pre != directory:
            obj = load_cached(cache_path(pre, key))
        if obj is None:
            obj = compile_in_subprocess(text, cflags)
        store(path, obj)
    return obj


__all__ = ["CompiledObject", "FunctionSpec", "MapSpec", "apply_relocations", "cache_key", "compile_cached",
           "default_cache_dir", "prebuilt_dir", "split_relocations"]
