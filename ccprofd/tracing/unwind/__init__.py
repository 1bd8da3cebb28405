"""Unwind mode: the stack unwound in BPF from CFI tables at each sample and Valence-encoded there."""
