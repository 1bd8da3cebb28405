"""BPF infrastructure.  BPF C is compiled once (bcc, behind :mod:`ccprofd.bpf.bcc_adapter`, run only
in the :mod:`ccprofd.bpf.compile_worker` subprocess) into a cached
:class:`~ccprofd.bpf.objcache.CompiledObject`, and loaded and attached with raw ``bpf(2)`` /
``perf_event_open(2)`` (:mod:`ccprofd.bpf.rawmodule`: maps in :mod:`~ccprofd.bpf.bpfmap`, ring
buffers in :mod:`~ccprofd.bpf.ringbuf`, attachments in :mod:`~ccprofd.bpf.attach`, uprobe_multi
links in :mod:`~ccprofd.bpf.uprobe_multi`); start-up feature probes; the samplers built on them.

Every failure is a one-line :class:`BPFError`; :class:`MissingFeature` is the subclass for absent
kernel/system features.  Importing this package does not import bcc.
"""

from ccprofd.bpf.errors import BPFError, MissingFeature

__all__ = ["BPFError", "MissingFeature"]
