"""x86-64 syscall numbers <-> names, for ``--syscalls write,openat`` and for the ``syscall`` field.

Read from the system's ``asm/unistd_64.h`` (the kernel UAPI header that defines ``__NR_<name>``);
a small built-in table covers machines without it.
"""

from __future__ import annotations

import functools
import re

HEADERS = ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h")
HEADERS_IA32 = ("/usr/include/x86_64-linux-gnu/asm/unistd_32.h", "/usr/include/asm/unistd_32.h")

#: An ia32 (compat) syscall, ``int $0x80`` in a 64-bit process, as a sample's number: this bit or'ed
#: into its ia32 number.  raw_syscalls reports such a call with its ia32 number, which names another
#: call in the x86-64 table (ia32 20, getpid, is x86-64 writev); the samplers' raw-path programs mark
#: it (the value reaches them in their #define prelude: :func:`compat_defines`), which puts it outside
#: every syscall set, and :func:`syscall_name` names it ``ia32:<name>``.
IA32_BIT = 0x20000000
#: thread_info.status's "a 32-bit syscall is in progress" flag (arch/x86/include/asm/thread_info.h)
TS_COMPAT = 0x0002
_DEFINE = re.compile(r"^#define __NR_(\w+)\s+(\d+)\s*$")

# The common ones, in case no header is installed (numbers are the x86-64 ABI, which never changes).
_FALLBACK = {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "poll": 7,
    "lseek": 8, "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13,
    "rt_sigprocmask": 14, "rt_sigreturn": 15, "ioctl": 16, "pread64": 17, "pwrite64": 18, "readv": 19,
    "writev": 20, "access": 21, "pipe": 22, "select": 23, "sched_yield": 24, "mremap": 25, "madvise": 28,
    "dup": 32, "dup2": 33, "nanosleep": 35, "getpid": 39, "socket": 41, "connect": 42, "accept": 43,
    "sendto": 44, "recvfrom": 45, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "exit": 60,
    "wait4": 61, "kill": 62, "uname": 63, "fcntl": 72, "getcwd": 79, "chdir": 80, "rename": 82,
    "mkdir": 83, "rmdir": 84, "unlink": 87, "readlink": 89, "getuid": 102, "getgid": 104, "geteuid": 107,
    "getegid": 108, "getppid": 110, "sigaltstack": 131, "arch_prctl": 158, "gettid": 186, "futex": 202,
    "getdents64": 217, "set_tid_address": 218, "clock_gettime": 228, "clock_nanosleep": 230,
    "exit_group": 231, "tgkill": 234, "openat": 257, "newfstatat": 262, "set_robust_list": 273,
    "pipe2": 293, "prlimit64": 302, "getrandom": 318, "execveat": 322, "rseq": 334, "clone3": 435,
}


def _read_header(paths: tuple[str, ...]) -> dict[str, int]:
    """name -> number from the first of ``paths`` that defines any ``__NR_<name>`` (empty: none)."""
    for path in paths:
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                table = {m.group(1): int(m.group(2)) for line in fh if (m := _DEFINE.match(line))}
        except OSError:
            continue
        if table:
            return table
    return {}


@functools.cache
def syscall_numbers() -> dict[str, int]:
    """name -> number."""
    return _read_header(HEADERS) or dict(_FALLBACK)


@functools.cache
def syscall_table() -> dict[int, str]:
    """number -> name."""
    return {nr: name for name, nr in syscall_numbers().items()}


@functools.cache
def ia32_syscall_table() -> dict[int, str]:
    """ia32 number -> name, from ``asm/unistd_32.h`` (empty without it: ``ia32:syscall_N``)."""
    return {nr: name for name, nr in _read_header(HEADERS_IA32).items()}


def syscall_number(name: str) -> int | None:
    """The inverse of :func:`syscall_name`: ``ia32:<name>`` (and ``ia32:syscall_N``) gives the marked
    ia32 number, ``syscall_N`` N; None for a name neither table has."""
    ia32 = name.startswith("ia32:")
    bare = name[5:] if ia32 else name
    names = {n: k for k, n in ia32_syscall_table().items()} if ia32 else syscall_numbers()
    nr = names.get(bare)
    if nr is None and bare.startswith("syscall_") and bare[8:].isdigit():
        nr = int(bare[8:])
    if nr is None:
        return None
    return nr | IA32_BIT if ia32 else nr


@functools.cache
def syscall_name(nr: int | None) -> str | None:
    """The name of syscall ``nr`` (``syscall_N`` when unknown; ``ia32:<name>`` for a compat call
    marked with :data:`IA32_BIT`); memoised: called once per sample."""
    if nr is None:
        return None
    if nr >= 0 and nr & IA32_BIT:
        n = nr & ~IA32_BIT
        return "ia32:" + ia32_syscall_table().get(n, f"syscall_{n}")
    return syscall_table().get(nr, f"syscall_{nr}")


def compat_defines() -> str:
    """The ``#define`` lines the raw-path programs mark compat syscalls with (:data:`IA32_BIT`)."""
    return f"#define CCPROF_IA32_BIT {IA32_BIT:#x}\n#define CCPROF_TS_COMPAT {TS_COMPAT:#x}\n"


# strace's syscall classes (``-e trace=%file`` ...), as strace 6 defines them for x86-64: %file
# takes a file name, %network the socket calls, %process the lifecycle of processes, %memory the
# mapping calls.  Names this kernel's table lacks are left out when expanded.
SYSCALL_CLASSES: dict[str, tuple[str, ...]] = {
    "%file": ("open", "stat", "lstat", "access", "execve", "truncate", "chdir", "rename", "mkdir", "rmdir",
              "creat", "link", "unlink", "symlink", "readlink", "chmod", "chown", "lchown", "utime", "mknod",
              "uselib", "statfs", "pivot_root", "chroot", "acct", "mount", "umount2", "swapon", "swapoff",
              "quotactl", "setxattr", "lsetxattr", "getxattr", "lgetxattr", "listxattr", "llistxattr",
              "removexattr", "lremovexattr", "utimes", "inotify_add_watch", "openat", "mkdirat", "mknodat",
              "fchownat", "futimesat", "newfstatat", "unlinkat", "renameat", "linkat", "symlinkat",
              "readlinkat", "fchmodat", "faccessat", "utimensat", "fanotify_mark", "name_to_handle_at",
              "renameat2", "execveat", "statx", "open_tree", "move_mount", "fspick", "openat2",
              "faccessat2", "mount_setattr", "fchmodat2", "setxattrat", "getxattrat", "listxattrat",
              "removexattrat"),
    "%network": ("socket", "connect", "accept", "sendto", "recvfrom", "sendmsg", "recvmsg", "shutdown",
                 "bind", "listen", "getsockname", "getpeername", "socketpair", "setsockopt", "getsockopt",
                 "accept4", "recvmmsg", "sendmmsg"),
    "%process": ("clone", "fork", "vfork", "execve", "exit", "wait4", "kill", "tkill", "tgkill", "exit_group",
                 "waitid", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "execveat", "pidfd_send_signal", "clone3"),
    "%memory": ("mmap", "mprotect", "munmap", "brk", "mremap", "msync", "mincore", "madvise", "shmat",
                "shmdt",
                "mlock", "munlock", "mlockall", "munlockall", "remap_file_pages", "mbind", "set_mempolicy",
                "get_mempolicy", "migrate_pages", "move_pages", "mlock2", "pkey_mprotect", "process_madvise",
                "process_mrelease", "mseal", "map_shadow_stack"),
}


def parse_syscalls(text: str | None) -> list[int] | None:
    """``"write,openat"`` -> numbers; ``None``/``"all"`` -> None (every syscall).  strace's classes
    (``%file``, ``%network``, ``%process``, ``%memory``) stand for their syscalls.  Raises ValueError
    naming the first unknown syscall or class."""
    if text is None or text.strip() == "all":
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--syscalls needs a comma-separated list of syscall names, or 'all'")
    table = syscall_numbers()
    out: list[int] = []
    for n in names:
        if n.isdigit():
            out.append(int(n))
        elif n in table:
            out.append(table[n])
        elif n in SYSCALL_CLASSES:
            out.extend(table[m] for m in SYSCALL_CLASSES[n] if m in table)
        elif n.startswith("%"):
            raise ValueError(f"unknown syscall class {n!r} (known: {', '.join(SYSCALL_CLASSES)})")
        else:
            raise ValueError(f"unknown syscall {n!r}")
    return sorted(set(out))


# The arguments of common syscalls (x86-64 kernel signatures, in register order), one letter each,
# for printing them strace-style: d int (fds, counts, commands), D a dirfd (AT_FDCWD for -100),
# u an unsigned size, l a signed 64-bit offset, x flags (hex), f open(2) flags (O_RDONLY|O_CLOEXEC),
# o a mode (octal; open's is left out unless the flags create, as strace does), p a pointer (NULL
# or hex), s a path (its string when it was captured at entry, else its pointer).  A syscall not
# here has its six argument registers printed in hex: which of them it uses is not known.
SYSCALL_ARGS: dict[str, str] = {
    "read": "dpu", "write": "dpu", "open": "sfo", "close": "d", "stat": "sp", "fstat": "dp",
    "lstat": "sp", "poll": "pud", "lseek": "dld", "mmap": "puxxdx", "mprotect": "pux", "munmap": "pu",
    "brk": "p", "rt_sigaction": "dppu", "rt_sigprocmask": "dppu", "rt_sigreturn": "", "ioctl": "dxp",
    "pread64": "dpul", "pwrite64": "dpul", "readv": "dpd", "writev": "dpd", "access": "sx", "pipe": "p",
    "sched_yield": "", "madvise": "pud", "dup": "d", "dup2": "dd", "nanosleep": "pp", "getpid": "",
    "socket": "ddd", "connect": "dpd", "accept": "dpp", "sendto": "dpuxpd", "recvfrom": "dpuxpp",
    "sendmsg": "dpx", "recvmsg": "dpx", "bind": "dpd", "listen": "dd", "clone": "xpppx", "fork": "",
    "vfork": "", "execve": "spp", "exit": "d", "wait4": "dpxp", "kill": "dd", "uname": "p",
    "fcntl": "ddx", "fsync": "d", "getcwd": "pu", "chdir": "s", "mkdir": "so", "unlink": "s",
    "readlink": "spu", "getuid": "", "getgid": "", "geteuid": "", "getegid": "", "getppid": "",
    "sigaltstack": "pp", "arch_prctl": "xp", "gettid": "", "futex": "pddppd", "getdents64": "dpu",
    "set_tid_address": "p", "clock_gettime": "dp", "clock_nanosleep": "dxpp", "exit_group": "d",
    "epoll_wait": "dpdd", "epoll_ctl": "dddp", "tgkill": "ddd", "openat": "Dsfo", "mkdirat": "Dso",
    "newfstatat": "Dspx", "unlinkat": "Dsx", "readlinkat": "Dspu", "faccessat": "Dsx",
    "set_robust_list": "pu", "epoll_pwait": "dpddpu", "accept4": "dppx", "epoll_create1": "x",
    "dup3": "ddx", "pipe2": "px", "prlimit64": "ddpp", "getrandom": "pux", "execveat": "Dsppx",
    "statx": "Dsxxp", "rseq": "puxx", "clone3": "pu", "openat2": "Dspu", "faccessat2": "Dsxx",
}


def syscall_arg_kinds(name: str | None) -> str | None:
    """The argument letters of syscall ``name`` (:data:`SYSCALL_ARGS`); None when not in the table.
    A compat call (``ia32:...``) has none: the samplers read the x86-64 argument registers, and an
    ia32 call passes its arguments in others."""
    if name and name.startswith("ia32:"):
        return ""
    return SYSCALL_ARGS.get(name) if name else None
