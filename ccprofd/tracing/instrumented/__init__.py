"""Instrumented mode: per-thread Valence state kept by uprobes on the plan's call sites."""
