"""ccprofd: calling-context profiler daemon (static call graph -> Valence plan -> BPF -> contexts)."""

__version__ = "0.1.0"
