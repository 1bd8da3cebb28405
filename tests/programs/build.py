"""Build the test programs of ``tests/programs/`` into ``tests/programs/build/``, with a cache.

``build(name, opt="O2", pie=False, strip=True)`` returns the path of the compiled (and optionally
stripped) program.  The output name carries a hash of everything that determines it -- the source
files (the program and the headers of ``COMMON_HEADERS``), the compiler's identity and the flags
-- so a repeated test run finds the binary already there, and a changed source or flag gets a new
file.  Every output is written to a temporary file in the same directory and renamed into place,
so two pytest processes building the same program at once both end up with a complete file.

Run ``python tests/programs/build.py`` to build every program in every variant the tests use.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Literal

HERE = pathlib.Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
COMMON_HEADERS = ("shapes.h", "cmdloop.h")

#: Every test program (stem of its source file), with what it exercises.
PROGRAMS: dict[str, str] = {
    "calls": "direct calls, several call sites between one pair, PLT calls (puts/write/open/getppid)",
    "recursion": "direct, mutual and 3-function recursion with a depth argument",
    "tailcall": "tail calls at -O2 (to a function and into the PLT)",
    "fptr": "function-pointer table, pointer returned at run time, qsort callback",
    "switch": "jump table (indirect jmp that is not a call) with calls in each case",
    "threads": "two pthreads with different start routines, recursing independently",
    "longjmp": "longjmp out of deep recursion",
    "exceptions": "C++ exception thrown through recursive frames",
    "sighandler": "signal handler that makes syscalls",
    "forks": "fork; child and parent make syscalls from different chains",
    "execs": "syscalls, then exec of /bin/echo",
    "vdso_loop": "clock_gettime/gettimeofday loops answered in the vDSO; a syscall made by the vDSO",
    "exithandlers": "syscalls from atexit handlers and a destructor after main returned",
    "spawns": "pthread_create (clone3), fork (clone), posix_spawn (clone3 CLONE_VFORK), vfork",
    "forkburst": "a fork child's syscalls, then its exec, between two bursts of 20,000 of the parent's",
}

Opt = Literal["O0", "O2"]


def source(name: str) -> pathlib.Path:
    """The source file of program ``name`` (``.c`` or ``.cpp``)."""
    for ext in (".c", ".cpp"):
        path = HERE / f"{name}{ext}"
        if path.exists():
            return path
    raise FileNotFoundError(f"no test program {name!r} in {HERE}")


@functools.cache
def _tool_identity(tool: str) -> str:
    out = subprocess.run([tool, "--version"], check=True, capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else tool


def compile_flags(name: str, *, opt: Opt, pie: bool, frame_pointer: bool | None, cet: bool) -> list[str]:
    """The compiler and its flags (without input/output files) for one variant."""
    src = source(name)
    compiler = "g++" if src.suffix == ".cpp" else "gcc"
    flags = [compiler, f"-{opt}", "-g", "-Wall", "-Wextra", "-pthread"]
    flags += ["-fpie", "-pie"] if pie else ["-fno-pie", "-no-pie"]
    if frame_pointer is True:
        flags += ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]
    elif frame_pointer is False:
        flags += ["-fomit-frame-pointer"]
    if cet:
        # endbr64 at function entries and an IBT PLT (.plt + .plt.sec), as on distributions with CET.
        flags += ["-fcf-protection=full", "-Wl,-z,ibtplt"]
    else:
        flags += ["-fcf-protection=none"]
    return flags


def _variant_tag(opt: Opt, pie: bool, frame_pointer: bool | None, cet: bool) -> str:
    parts = [opt, "pie" if pie else "nopie"]
    if frame_pointer is not None:
        parts.append("fp" if frame_pointer else "nofp")
    if cet:
        parts.append("cet")
    return "-".join(parts)


def _atomic_output(final: pathlib.Path) -> pathlib.Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return pathlib.Path(tmp)


def build(name: str, *, opt: Opt = "O0", pie: bool = True, strip: bool = False,
          frame_pointer: bool | None = None, cet: bool = False) -> pathlib.Path:
    """Compile program ``name`` (cached) and return the path of the binary.

    ``opt``: "O0" or "O2".  ``pie``: ``-fpie -pie`` or ``-fno-pie -no-pie``.  ``strip``: return a
    copy processed by ``strip`` (same code, no ``.symtab``/debug info).  ``frame_pointer``: True
    forces frame pointers, False omits them, None keeps the compiler default.  ``cet``: build with
    ``-fcf-protection=full`` and an IBT PLT (``.plt.sec``).
    """
    if opt not in ("O0", "O2"):
        raise ValueError(f"opt must be 'O0' or 'O2', not {opt!r}")
    src = source(name)
    flags = compile_flags(name, opt=opt, pie=pie, frame_pointer=frame_pointer, cet=cet)
    key = hashlib.sha256()
    for part in (src.read_bytes(), *((HERE / h).read_bytes() for h in COMMON_HEADERS)):
        key.update(hashlib.sha256(part).digest())
    key.update(_tool_identity(flags[0]).encode())
    key.update("\0".join(flags).encode())
    digest = key.hexdigest()[:12]

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    binary = BUILD_DIR / f"{name}-{_variant_tag(opt, pie, frame_pointer, cet)}-{digest}"
    if not binary.exists():
        tmp = _atomic_output(binary)
        try:
            proc = subprocess.run([*flags, "-I", str(HERE), "-o", str(tmp), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(flags)}\n{proc.stderr}")
            tmp.chmod(0o755)
            os.replace(tmp, binary)
        finally:
            tmp.unlink(missing_ok=True)
    if not strip:
        return binary

    stripped = binary.with_name(binary.name + ".stripped")
    if not stripped.exists():
        tmp = _atomic_output(stripped)
        try:
            subprocess.run([shutil.which("strip") or "strip", "-o", str(tmp), str(binary)], check=True,
                           capture_output=True)
            tmp.chmod(0o755)
            os.replace(tmp, stripped)
        finally:
            tmp.unlink(missing_ok=True)
    return stripped


def all_variants() -> list[dict[str, object]]:
    """The variants the call-graph tests use (keyword arguments of :func:`build`)."""
    out: list[dict[str, object]] = []
    for opt in ("O0", "O2"):
        for pie in (True, False):
            for strip in (False, True):
                out.append({"opt": opt, "pie": pie, "strip": strip})
    return out


def main(argv: list[str]) -> int:
    names = argv or list(PROGRAMS)
    for name in names:
        for variant in all_variants():
            print(build(name, **variant))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
