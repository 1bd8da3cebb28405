"""BPF infrastructure.  BPF C is compiled once (bcc, behind :mod:`ccprofd.kbpf.bcc_adapter`, run only
in the :mod:`ccprofd.kbpf.compile_worker` subprocess) into a cached
:class:`~ccprofd.kbpf.objcache.CompiledObject`, and loaded and attached with raw ``bpf(2)`` /
``perf_event_open(2)`` (:mod:`ccprofd.kbpf.rawmodule`: maps in :mod:`~ccprofd.kbpf.bpfmap`, ring
buffers in :mod:`~ccprofd.kbpf.ringbuf`, attachments in :mod:`~ccprofd.kbpf.attach`, uprobe_multi
links in :mod:`~ccprofd.kbpf.uprobe_multi`); the kernel ABI layouts in :mod:`~ccprofd.kbpf.abi`;
tracefs in :mod:`~ccprofd.kbpf.tracefs`; start-up feature probes.  The samplers built on them are
in :mod:`ccprofd.tracing`.

Every failure is a one-line :class:`BPFError`; :class:`MissingFeature` is the subclass for absent
kernel/system features.  Importing this package does not import bcc.
"""

from ccprofd.kbpf.errors import BPFError, MissingFeature

__all__ = ["BPFError", "MissingFeature"]
