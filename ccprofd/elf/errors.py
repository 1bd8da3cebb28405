"""Domain errors of reading an ELF object: each carries the file and a one-line reason."""

from __future__ import annotations


class BinaryError(Exception):
    """The input file cannot be analysed (bad input: exit status 2)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CfiError(ValueError):
    """A ``.eh_frame``/``.debug_frame`` section that cannot be read (truncated entry, a CIE offset
    outside the section, an unknown opcode or pointer encoding).  Raised by the CFI readers, which
    see bytes, not files; the callers that know the file turn it into a :class:`BinaryError`."""
