"""The shipped unit's sandbox as far as it can be built without systemd as PID 1 (this VM's
systemd is not running: ``systemd-run`` cannot start a unit), for tests that run the real daemon
in it.  What :func:`sandbox_prefix` reproduces, the way systemd 252 sets it up
(src/core/namespace.c, src/core/execute.c):

* ``PrivateMounts=yes``: a private mount namespace (every other directive below lives in it);
* ``ProtectProc=invisible``: a new procfs on /proc with ``hidepid=invisible``;
* ``ProtectKernelTunables=yes``: /sys and every mount below it (tracefs, debugfs, bpffs, cgroup)
  remounted read-only, /proc/sys and the other /proc tunables read-only, /proc/kallsyms (and
  /proc/kcore where it exists) covered by an empty mode-0000 file;
* ``CapabilityBoundingSet=`` (the unit's list) and ``NoNewPrivileges=yes``, with setpriv;
* ``RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6``: a seccomp filter making ``socket(2)`` of
  any other family fail with EAFNOSUPPORT, as systemd's does.

Not reproduced: ``IPAddressDeny=``/``IPAddressAllow=`` (systemd attaches cgroup BPF programs to the
unit's cgroup), ``PrivateTmp=``/``ProtectSystem=``/``ProtectHome=`` (unchanged by issue 17; the tests'
work directories are under /tmp).
"""

from __future__ import annotations

import configparser
from pathlib import Path

from bpf_helpers import compile_c
from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]

SECCOMP_C = r"""
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
/* exec argv[1..] with socket(2) of families other than AF_UNIX/AF_INET/AF_INET6 failing EAFNOSUPPORT */
int main(int argc, char **argv) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socket, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_UNIX, 3, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_INET, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_INET6, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EAFNOSUPPORT),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (argc < 2) return 2;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        return 126;
    }
    execvp(argv[1], argv + 1);
    perror("exec");
    return 127;
}
"""

MOUNTS = r"""
set -e
mount -t proc -o hidepid=invisible proc /proc
for mp in $(awk '$5 ~ "^/sys(/|$)" {print $5}' /proc/self/mountinfo | sort -u); do
  mount -o remount,bind,ro "$mp"
done
for p in /proc/sys /proc/sysrq-trigger /proc/latency_stats /proc/acpi /proc/fs /proc/irq /proc/timer_list \
         /proc/bus /proc/scsi /proc/asound /proc/apm /proc/mtrr; do
  [ -e "$p" ] || continue
  mount --bind "$p" "$p"
  mount -o remount,bind,ro "$p"
done
mount --bind "$INACCESSIBLE" /proc/kallsyms
[ ! -e /proc/kcore ] || mount --bind "$INACCESSIBLE" /proc/kcore
exec "$@"
"""


def unit_capabilities() -> list[str]:
    """The shipped unit's CapabilityBoundingSet, in setpriv's spelling."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((ROOT / "systemd" / "ccprofd.service").read_text())
    return [c.lower().removeprefix("cap_") for c in parser["Service"]["CapabilityBoundingSet"].split()]


def sandbox_prefix(tmp_path: Path) -> list[str]:
    """argv prefix that runs a command in the sandbox (the command's pid is the prefix's: every
    step execs the next)."""
    wrapper = compile_c(tmp_path, "restrict_af", SECCOMP_C, "-O2")
    inaccessible = tmp_path / "inaccessible"
    inaccessible.write_bytes(b"")
    inaccessible.chmod(0)
    caps = ",".join(["-all", *(f"+{c}" for c in unit_capabilities())])
    return [require_tool("unshare"), "-m", "--propagation", "private", "env", f"INACCESSIBLE={inaccessible}",
            "bash", "-c", MOUNTS, "bash", require_tool("setpriv"), f"--bounding-set={caps}",
            "--no-new-privs", str(wrapper)]
