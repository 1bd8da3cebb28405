"""bench's workload launcher runs every workload (untraced, traced, under strace) without address-space
randomisation, so separate runs of a program whose syscalls depend on its addresses (python3.11's
obmalloc arenas: README, python-json syscall #288) make the same syscalls.  Checked on the kernel's
own record: the personality word of the exec'd child (/proc/PID/personality), and two launched
runs printing the address of a fresh mmap."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import report_bpf as rb

SCRIPT = "import mmap, sys; m = mmap.mmap(-1, 4096); open(sys.argv[1], 'w').write(str(id(m)) + ' ' + " \
         "open('/proc/self/personality').read())"


def _run(out: Path) -> tuple[str, int]:
    child = rb.launch([sys.executable, "-S", "-c", SCRIPT, str(out)])
    child.release()
    assert rb.wait_exit(child.pid).code == 0
    addr, pers = out.read_text().split()
    return addr, int(pers, 16)


def test_launched_workloads_run_without_aslr(tmp_path: Path) -> None:
    a, pa = _run(tmp_path / "a")
    b, pb = _run(tmp_path / "b")
    assert pa & 0x0040000 and pb & 0x0040000
    assert a == b  # the same object address in two runs: the same layout
