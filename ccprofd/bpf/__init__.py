"""BPF infrastructure: the bcc adapter (the only importer of bcc, imported lazily), uprobe_multi
links through raw ``bpf(2)``, start-up feature probes, and the syscall sampler.

Every failure is a one-line :class:`BPFError`; :class:`MissingFeature` is the subclass for absent
kernel/system features.  Importing this package does not import bcc.
"""

from ccprofd.bpf.errors import BPFError, MissingFeature

__all__ = ["BPFError", "MissingFeature"]
