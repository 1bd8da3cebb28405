"""Enforcement of an anomaly model: an open, exec or connect from a calling context outside the
model is denied (BPF LSM, ``-EPERM``) or, where BPF LSM programs cannot be loaded, the process is
killed with ``bpf_send_signal(SIGKILL)`` at syscall entry (the syscall may then complete, but the
program never runs past it).

How the kernel side knows the context (see lsm_enforce.c): uprobes on the target's calls into the
PLT hash the context at that call (call site + frame-pointer chain within the target, as file
offsets) and the hook uses the hash if that call is still on the stack.  :func:`context_hash`
computes the same hash from a model's decoded frames, so the allowed set is exactly the model's
contexts of the hooked syscalls.  Requirements and limits of this standalone key, stated rather
than guessed around: the target must keep frame pointers (contexts it cannot key are reported);
a syscall reached by a tail jump into the PLT, an indirect call to a library function, or a
callback from library code is keyed by the frames the walk can see, which a model learned from the
tracer does not contain — those contexts are denied and counted.  Allow rules (prefixes) are not
expressible as finite keys and are reported, not enforced.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ccprofd.anomaly.model import TAIL_CALL, TargetModel
from ccprofd.elf.addrspace import AddressSpace
from ccprofd.kbpf.cdefs import c_constants
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.tracefs import tracepoint_field_offset
from ccprofd.tracing.syscall_sampler import SamplerEvent, SyscallSampler

LSM_FILE = "/sys/kernel/security/lsm"
SECURITYFS = "/sys/kernel/security"

C_SOURCE = "lsm_enforce.c"
_C = c_constants(Path(__file__).with_name(C_SOURCE))  # the constants shared with the C (kbpf/cdefs.py)
HOOK_FILE_OPEN, HOOK_EXEC, HOOK_CONNECT = _C["HOOK_FILE_OPEN"], _C["HOOK_EXEC"], _C["HOOK_CONNECT"]
HOOK_NAMES = {HOOK_FILE_OPEN: "file_open", HOOK_EXEC: "bprm_check_security", HOOK_CONNECT: "socket_connect"}
#: x86-64 numbers of the syscalls each hook guards (ABI constants).
SYSCALL_HOOKS: dict[str, tuple[int, int]] = {
    "open": (2, HOOK_FILE_OPEN), "creat": (85, HOOK_FILE_OPEN), "openat": (257, HOOK_FILE_OPEN),
    "openat2": (437, HOOK_FILE_OPEN), "execve": (59, HOOK_EXEC), "execveat": (322, HOOK_EXEC),
    "connect": (42, HOOK_CONNECT)}

KEY_SEED, KEY_PRIME, KEY_NONE = _C["KEY_SEED"], _C["KEY_PRIME"], _C["KEY_NONE"]
_MASK = (1 << 64) - 1
VERDICTS = {_C["VERDICT_ALLOWED"]: "allowed", _C["VERDICT_DENIED"]: "denied", _C["VERDICT_KILLED"]: "killed"}
ENF_ARMED, ENF_ACTIVE = _C["ENF_ARMED"], _C["ENF_ACTIVE"]  # enf_procs values
_EXTRA = struct.Struct("<QII")


def _mix(h: int, v: int) -> int:
    return ((h ^ v) * KEY_PRIME) & _MASK


def context_hash(call_site_offset: int, return_offsets: Sequence[int]) -> int:
    """The kernel's key: call site, then return addresses innermost first (file offsets)."""
    h = _mix(KEY_SEED, call_site_offset)
    for off in return_offsets:
        h = _mix(h, off)
    return h


@dataclass(frozen=True, slots=True)
class LsmStatus:
    active: bool
    lsm_list: str
    mounted_securityfs: bool
    detail: str


def lsm_status(*, mount: bool = True) -> LsmStatus:
    """Whether ``bpf`` is in the active LSM list, mounting securityfs first when it is not mounted."""
    mounted = False
    if not os.path.exists(LSM_FILE) and mount and os.path.isdir(SECURITYFS):
        r = subprocess.run(["mount", "-t", "securityfs", "securityfs", SECURITYFS], capture_output=True,
                           text=True)
        mounted = r.returncode == 0
    try:
        with open(LSM_FILE, encoding="ascii") as fh:
            lsms = fh.read().strip()
    except OSError as exc:
        return LsmStatus(False, "", mounted, f"cannot read {LSM_FILE}: {exc.strerror}")
    active = "bpf" in lsms.split(",")
    return LsmStatus(active, lsms, mounted, f"{LSM_FILE}: {lsms}")


@dataclass
class AllowedSet:
    """Kernel keys of a model's contexts, and what could not be keyed (reported, never guessed)."""

    keys: set[tuple[int, int]]
    unkeyed: int
    ignored_rules: int


def allowed_keys(model: TargetModel, addrspace: AddressSpace, *, lsm: bool) -> AllowedSet:
    """The (hook, key) pairs of every context of a hooked syscall in ``model``.  With BPF LSM, an
    exec's context also allows the ``file_open`` of the binary it execs."""
    keys: set[tuple[int, int]] = set()
    unkeyed = 0
    for (syscall, frames), _ in model.contexts.items():
        hook_of = SYSCALL_HOOKS.get(syscall)
        if hook_of is None:
            continue
        hook = hook_of[1]
        key = _key_of(model, frames, addrspace)
        if key is None:
            unkeyed += 1
            continue
        keys.add((hook, key))
        if lsm and hook == HOOK_EXEC:
            keys.add((HOOK_FILE_OPEN, key))
    return AllowedSet(keys, unkeyed, len(model.allow_rules))


def _key_of(model: TargetModel, frames: Sequence[tuple[str, str, str | None]],
            aspace: AddressSpace) -> int | None:
    # Library frames inward of the binary's last call (unwind mode reports them) are below the
    # PLT call the kernel side keys on.
    n = len(frames)
    while n and frames[n - 1][0] != model.build_id:
        n -= 1
    if n == 0:
        return KEY_NONE  # no frame of the binary: the loader, or code the binary never called into
    frames = frames[:n]
    inner = frames[-1]
    if inner[0] != model.build_id or inner[2] is None:
        return None
    try:
        site = aspace.vaddr_to_offset(int(inner[2], 16))
        rets: list[int] = []
        for mid, _fn, call_site in reversed(frames[:-1]):
            if mid != model.build_id:
                break
            ret = model.return_addresses.get((mid, call_site)) if call_site is not None else None
            if ret is None:
                return None
            if ret == TAIL_CALL:
                continue  # replaced by its callee: not on the stack the kernel walks
            rets.append(aspace.vaddr_to_offset(int(ret, 16)))
    except ValueError:
        return None
    return context_hash(site, rets)


@dataclass(frozen=True, slots=True)
class Denial:
    """One checked operation the kernel side did not find in the allowed set."""

    pid: int
    tid: int
    syscall_nr: int
    hook: str
    key: int
    verdict: str  # "denied" (LSM -EPERM, or audit only) | "killed" (SIGKILL fallback)


class Enforcer:
    """Load the enforcement programs for one target binary and one model; :meth:`launch` a command
    under them.  ``enforce=False`` only reports (audit mode)."""

    def __init__(self, binary: str, model: TargetModel, *, enforce: bool = True, prefer_lsm: bool = True,
                 max_stack: int = 64) -> None:
        from ccprofd.callgraph import analyze_binary
        from ccprofd.elf.image import ElfImage

        image = ElfImage(binary)
        if image.build_id() != model.build_id:
            raise BPFError(f"{binary} has build-id {image.build_id()}, the model is for {model.build_id}")
        graph = analyze_binary(binary)
        sites = [s for s in graph.sites if s.kind == "plt" and not s.is_jump]
        if not sites:
            raise BPFError(f"{binary}: no calls into the PLT to key contexts on")
        self.binary = image.path
        self.status = lsm_status()
        self.mode = "signal"
        self.lsm_error = "" if self.status.active else f"bpf not in active LSMs ({self.status.detail})"
        syscalls = [nr for nr, _ in SYSCALL_HOOKS.values()]
        source = Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")
        child_pid_at = tracepoint_field_offset("sched", "sched_process_fork", "child_pid")
        defines = f"#define MAX_STACK {max_stack}\n#define FORK_CHILD_PID_OFFSET {child_pid_at}\n"
        sampler: SyscallSampler | None = None
        if self.status.active and prefer_lsm:
            try:
                sampler = SyscallSampler(syscalls=syscalls, prelude=defines + "#define CCPROF_ENFORCE_LSM 1\n"
                                         + source)
                self.mode = "lsm"
            except BPFError as exc:
                self.lsm_error = f"BPF LSM programs could not be loaded: {exc}"
        if sampler is None:
            sampler = SyscallSampler(syscalls=syscalls, prelude=defines + source)
        self.sampler = sampler
        self.allowed = allowed_keys(model, image.addrspace, lsm=self.mode == "lsm")
        mod = sampler.module
        try:
            target = mod.map("enf_target")
            value = target.leaf_type()
            bid = bytes.fromhex(model.build_id)[:20]
            for i, b in enumerate(bid):
                value.build_id[i] = b
            target.set(0, value)
            allowed = mod.map("enf_allowed")
            items = []
            for hook, key in self.allowed.keys:
                k = allowed.key_type()
                k.hook, k.key = hook, key
                items.append((k, 1))
            allowed.update_many(items)
            mod.map("enf_config").set(0, 1 if enforce else 0)
            from ccprofd.kbpf.uprobe_multi import attach_uprobe_multi

            prog = mod.load_func("enf_site", "kprobe", attach_type=48)
            offsets = [image.addrspace.vaddr_to_offset(s.address) for s in sites]
            cookies = [image.addrspace.vaddr_to_offset(s.address) | (s.length << 48) for s in sites]
            self._link = attach_uprobe_multi(prog, self.binary, offsets, cookies)
            mod.attach_tracepoint("sched:sched_process_fork", "enf_fork")
            mod.attach_tracepoint("sched:sched_process_exec", "enf_exec")
            mod.attach_tracepoint("sched:sched_process_exit", "enf_exit")
            sampler.attach()
            self._procs = mod.map("enf_procs")
        except BaseException:
            sampler.close()
            raise
        self.sites = len(sites)

    def launch(self, argv: Sequence[str]) -> int:
        """Start ``argv`` (its first exec is the target) with enforcement from its first instruction;
        returns its pid (wait with :func:`wait_status`)."""
        args = list(argv)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: wait until tracked, then exec
            try:
                os.close(w)
                os.read(r, 1)
                os.close(r)
                os.execvp(args[0], args)
            finally:
                os._exit(127)
        os.close(r)
        try:
            self.track_launch(pid)
        finally:
            os.write(w, b"g")
            os.close(w)
        return pid

    def track_launch(self, pid: int) -> None:
        """Enforce on ``pid``, a child that has yet to exec the target (someone else's launcher,
        e.g. the tracer's gated child): armed now, active from its exec of the target on."""
        self._procs.set(pid, ENF_ARMED)
        self.sampler.track(pid, execs=1)

    def track_running(self, pid: int) -> None:
        """Enforce on ``pid``, already running the target (the daemon).  Its threads have no
        recorded PLT call until their next one: a hooked syscall made before that is keyed as
        KEY_NONE (no context in the binary), as for code outside the binary."""
        self._procs.set(pid, ENF_ACTIVE)
        self.sampler.track(pid)

    def untrack(self, pid: int) -> None:
        self._procs.delete(pid)
        with contextlib.suppress(KeyError, BPFError):
            self.sampler.untrack(pid)

    def poll(self, timeout_ms: int = 0) -> list[Denial]:
        out: list[Denial] = []
        for ev in self.sampler.poll(timeout_ms):
            d = _denial(ev)
            if d is not None:
                out.append(d)
        return out

    def stats(self) -> dict[str, int]:
        names = ("site_hits", "stale", "denied", "checked")
        per = self.sampler.module.map("enf_stats")
        return {n: int(per.get(i) or 0) for i, n in enumerate(names)}

    def close(self) -> None:
        link = getattr(self, "_link", None)
        if link is not None:
            link.close()
        self.sampler.close()

    def __enter__(self) -> Enforcer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_status(pid: int) -> int:
    """Exit status of a launched child like subprocess: negative signal number when killed."""
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _denial(ev: SamplerEvent) -> Denial | None:
    if ev.kind != "syscall" or len(ev.extra) < _EXTRA.size or ev.syscall is None:
        return None
    key, hook, verdict = _EXTRA.unpack_from(ev.extra)
    if verdict in (0, 1):
        return None
    return Denial(ev.tgid, ev.tid, ev.syscall, HOOK_NAMES.get(hook, str(hook)), key,
                  VERDICTS.get(verdict, "?"))


def check_features() -> list[str]:
    """Human-readable lines on what enforcement can use on this machine (for reports and tests)."""
    st = lsm_status()
    lines = [f"securityfs mounted now: {st.mounted_securityfs}", st.detail, f"bpf LSM active: {st.active}"]
    return lines

