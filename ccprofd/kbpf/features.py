"""Start-up probes of the kernel and system features ccprofd's BPF layer needs.

Each probe does the real thing on a throw-away object (load a two-instruction program, create a
map, create a link on a file nobody maps) instead of trusting version strings, because distribution
kernels backport and configs differ.  A failed probe yields a one-line :class:`MissingFeature`
(``ccprofd: missing kernel feature: <feature> (<why>)``) that the CLI prints before exiting 1.
"""

from __future__ import annotations

import os
import platform
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.errors import BPFError, MissingFeature
from ccprofd.kbpf.tracefs import tracefs_dir

CAP_PERFMON = 38
CAP_BPF = 39
CAP_SYS_ADMIN = 21


@dataclass(frozen=True, slots=True)
class FeatureResult:
    """Outcome of one probe: ``ok`` or the MissingFeature describing what is absent."""

    name: str
    ok: bool
    error: MissingFeature | None = None


def _effective_caps() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def probe_privileges() -> None:
    """root, or CAP_BPF + CAP_PERFMON (uprobes and tracing programs need both)."""
    if os.geteuid() == 0:
        return
    caps = _effective_caps()
    have_bpf = bool(caps & (1 << CAP_BPF)) or bool(caps & (1 << CAP_SYS_ADMIN))
    have_perfmon = bool(caps & (1 << CAP_PERFMON)) or bool(caps & (1 << CAP_SYS_ADMIN))
    if not (have_bpf and have_perfmon):
        raise MissingFeature("BPF privileges", "run as root or with CAP_BPF and CAP_PERFMON")


PERMISSION_HINT = "tracing needs root, or CAP_BPF and CAP_PERFMON"


def privileges_problem() -> str | None:
    """One line for the CLI when this process may not trace (None when it may): said before
    anything else fails with a misleading EPERM or an unreadable tracefs."""
    try:
        probe_privileges()
    except MissingFeature:
        return f"permission denied: {PERMISSION_HINT} (running as uid {os.geteuid()})"
    return None


def max_sample_hz() -> int | None:
    """The kernel's ceiling for CPU-clock sampling (``kernel.perf_event_max_sample_rate``)."""
    try:
        with open("/proc/sys/kernel/perf_event_max_sample_rate", encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def sample_hz_over_limit(hz: int) -> str | None:
    """Why CPU sampling at ``hz`` cannot be asked of this kernel (None: it can), as the CLI options
    and the daemon's ``perf_sample_hz`` say it."""
    ceiling = max_sample_hz()
    if ceiling is not None and hz > ceiling:
        return f"{hz} exceeds the kernel's limit (kernel.perf_event_max_sample_rate = {ceiling})"
    return None


def probe_bcc() -> None:
    """bcc's Python module imports (it loads libbcc.so)."""
    from ccprofd.kbpf.bcc_adapter import bcc_available

    reason = bcc_available()
    if reason is not None:
        raise MissingFeature("bcc (python3-bpfcc)", reason)


def kernel_headers_dir() -> str | None:
    """Where bcc will find kernel headers for the running kernel, or None."""
    release = platform.release()
    for sub in ("build", "source"):
        d = f"/lib/modules/{release}/{sub}"
        if os.path.isdir(os.path.join(d, "include")):
            return d
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return "/sys/kernel/kheaders.tar.xz"
    return None


def probe_kernel_headers() -> None:
    """bcc compiles C against the running kernel's headers (/lib/modules/$(uname -r)/build)."""
    if kernel_headers_dir() is None:
        raise MissingFeature(
            "kernel headers",
            f"/lib/modules/{platform.release()}/build is missing; install linux-headers or run set-up",
        )


def probe_tracefs() -> None:
    """Tracepoint attachment and the tracepoint formats bcc reads live in tracefs."""
    if tracefs_dir() is None:
        raise MissingFeature("tracefs", "mount -t tracefs tracefs /sys/kernel/tracing")


def _trivial_prog(prog_type: int, expected_attach_type: int = 0, name: str = "ccprofd_probe") -> int:
    return rawbpf.prog_load(
        prog_type,
        rawbpf.mov64_imm(0, 0) + rawbpf.exit_insn(),
        expected_attach_type=expected_attach_type,
        name=name,
    )


def probe_uprobe_multi() -> None:
    """Create a real uprobe_multi link — on a scratch file no process maps, so no breakpoint is ever
    written into a running program — and close it."""
    from ccprofd.kbpf.uprobe_multi import attach_uprobe_multi

    feature, need = "uprobe_multi links", "needs Linux >= 6.6"
    try:
        prog = _trivial_prog(rawbpf.BPF_PROG_TYPE_KPROBE, rawbpf.BPF_TRACE_UPROBE_MULTI, "ccprofd_umulti")
    except BPFError as exc:
        raise MissingFeature(feature, f"{need}; {exc}") from None
    try:
        with tempfile.NamedTemporaryFile(prefix="ccprofd-uprobe-probe-") as tmp:
            tmp.write(b"\x90" * 64)
            tmp.flush()
            try:
                link = attach_uprobe_multi(prog, tmp.name, [0], [1])
            except BPFError as exc:
                raise MissingFeature(feature, f"{need}; {exc}") from None
            link.close()
    finally:
        os.close(prog)


def probe_bpf_loop() -> None:
    """Load a program that calls ``bpf_loop`` (Linux >= 5.17) with a trivial callback."""
    insns = (
        rawbpf.mov64_imm(1, 1)  # nr_loops
        + rawbpf.ld_pseudo_func(2, 6)  # callback = insn 1 + 6 + 1 = 8
        + rawbpf.mov64_imm(3, 0)  # callback_ctx
        + rawbpf.mov64_imm(4, 0)  # flags
        + rawbpf.call_helper(rawbpf.BPF_FUNC_LOOP)
        + rawbpf.mov64_imm(0, 0)
        + rawbpf.exit_insn()
        + rawbpf.mov64_imm(0, 0)  # insn 8: callback body, "continue"
        + rawbpf.exit_insn()
    )
    feature = "bpf_loop helper"
    try:
        # The verifier wants BTF FUNC info for the callback subprogram.
        btf = rawbpf.btf_load(rawbpf.int_btf(["ccprofd_main", "ccprofd_cb"]))
    except BPFError as exc:
        raise MissingFeature(feature, f"BTF loading failed; {exc}") from None
    try:
        fd = rawbpf.prog_load(
            rawbpf.BPF_PROG_TYPE_TRACEPOINT,
            insns,
            name="ccprofd_loop",
            btf_fd=btf,
            func_info=[(0, 3), (8, 4)],
        )
    except BPFError as exc:
        raise MissingFeature(feature, f"needs Linux >= 5.17; {exc}") from None
    finally:
        os.close(btf)
    os.close(fd)


def probe_task_storage() -> None:
    """Create a BPF_MAP_TYPE_TASK_STORAGE map (per-thread state; Linux >= 5.11, needs BTF)."""
    feature = "task storage maps"
    try:
        btf = rawbpf.btf_load(rawbpf.int_btf())
    except BPFError as exc:
        raise MissingFeature(feature, f"BTF loading failed; {exc}") from None
    try:
        fd = rawbpf.map_create(
            rawbpf.BPF_MAP_TYPE_TASK_STORAGE,
            4,
            4,
            0,
            flags=rawbpf.BPF_F_NO_PREALLOC,
            btf_fd=btf,
            btf_key_type_id=1,
            btf_value_type_id=1,
            name="ccprofd_tstor",
        )
    except BPFError as exc:
        raise MissingFeature(feature, f"needs Linux >= 5.11; {exc}") from None
    finally:
        os.close(btf)
    os.close(fd)


def probe_ringbuf() -> None:
    """Create a BPF ring buffer map (Linux >= 5.8)."""
    try:
        fd = rawbpf.map_create(
            rawbpf.BPF_MAP_TYPE_RINGBUF, 0, 0, os.sysconf("SC_PAGE_SIZE"), name="ccprofd_rb"
        )
    except BPFError as exc:
        raise MissingFeature("BPF ring buffer", f"needs Linux >= 5.8; {exc}") from None
    os.close(fd)


def probe_btf() -> None:
    """Kernel BTF (bpf_get_current_task_btf, task storage from programs)."""
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        raise MissingFeature("kernel BTF", "/sys/kernel/btf/vmlinux missing: needs CONFIG_DEBUG_INFO_BTF")


# Probe names, in the order they are checked: later probes presuppose earlier ones.
PROBES: dict[str, Callable[[], None]] = {
    "privileges": probe_privileges,
    "bcc": probe_bcc,
    "kernel_headers": probe_kernel_headers,
    "tracefs": probe_tracefs,
    "btf": probe_btf,
    "ringbuf": probe_ringbuf,
    "bpf_loop": probe_bpf_loop,
    "task_storage": probe_task_storage,
    "uprobe_multi": probe_uprobe_multi,
}
ALL_FEATURES: frozenset[str] = frozenset(PROBES)

# What each privileged probe presupposes: without privileges every raw bpf() call fails with EPERM,
# and reporting "no ring buffer" for that would mislead.
_NEEDS_PRIVILEGES = frozenset({"ringbuf", "bpf_loop", "task_storage", "uprobe_multi"})


def probe_features(names: Iterable[str] = ALL_FEATURES) -> list[FeatureResult]:
    """Run the named probes (all by default) and report each, without raising."""
    wanted = set(names)
    unknown = wanted - ALL_FEATURES
    if unknown:
        raise ValueError(f"unknown feature(s): {', '.join(sorted(unknown))}")
    if wanted & _NEEDS_PRIVILEGES:
        wanted.add("privileges")
    results: list[FeatureResult] = []
    privileged = True
    for name, probe in PROBES.items():
        if name not in wanted:
            continue
        if name in _NEEDS_PRIVILEGES and not privileged:
            continue  # the privileges failure already explains it
        try:
            probe()
        except MissingFeature as exc:
            results.append(FeatureResult(name, False, exc))
            if name == "privileges":
                privileged = False
        else:
            results.append(FeatureResult(name, True))
    return results


def check_features(required: set[str]) -> None:
    """Raise MissingFeature for the first required feature that is absent (probe order), so the
    CLI can print its one-line message and exit 1."""
    for res in probe_features(required):
        if res.error is not None:
            raise res.error
