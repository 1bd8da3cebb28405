"""Explicit address translation for one ELF object: ELF vaddr <-> file offset <-> runtime address.

Kept in one place (as angr/cle does) so that no other module does ad-hoc segment arithmetic.
uprobes want *file offsets*, the plan and decoded frames speak *ELF virtual addresses*, and a
running process sees *runtime addresses* = vaddr + load bias.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD program header."""

    vaddr: int
    memsz: int
    offset: int
    filesz: int
    flags: int  # PF_X=1, PF_W=2, PF_R=4

    @property
    def executable(self) -> bool:
        return bool(self.flags & 1)


class AddressSpace:
    """PT_LOAD segments of one object, sorted by vaddr."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = sorted(segments, key=lambda s: s.vaddr)
        self._starts = [s.vaddr for s in self.segments]

    def segment_of(self, vaddr: int) -> Segment | None:
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            seg = self.segments[i]
            if vaddr < seg.vaddr + seg.memsz:
                return seg
        return None

    def vaddr_to_offset(self, vaddr: int) -> int:
        """File offset of ``vaddr``; ValueError if it is not backed by file bytes."""
        seg = self.segment_of(vaddr)
        if seg is None or vaddr - seg.vaddr >= seg.filesz:
            raise ValueError(f"vaddr {vaddr:#x} is not backed by the file")
        return seg.offset + (vaddr - seg.vaddr)

    def offset_to_vaddr(self, offset: int) -> int:
        for seg in self.segments:
            if seg.offset <= offset < seg.offset + seg.filesz:
                return seg.vaddr + (offset - seg.offset)
        raise ValueError(f"file offset {offset:#x} is in no PT_LOAD segment")

    def is_executable(self, vaddr: int) -> bool:
        seg = self.segment_of(vaddr)
        return seg is not None and seg.executable

    @property
    def lowest_vaddr(self) -> int:
        return self.segments[0].vaddr if self.segments else 0

    def load_bias(self, mapping_start: int, mapping_offset: int, page_size: int = 4096) -> int:
        """Load bias from one /proc/PID/maps line (mapping start address and file offset).

        The kernel maps each PT_LOAD from its page-aligned offset to its page-aligned vaddr.
        """
        mask = ~(page_size - 1)
        for seg in self.segments:
            if seg.offset & mask == mapping_offset:
                return mapping_start - (seg.vaddr & mask)
        raise ValueError(f"no PT_LOAD segment is mapped from file offset {mapping_offset:#x}")

    def to_runtime(self, vaddr: int, bias: int) -> int:
        return vaddr + bias

    def from_runtime(self, address: int, bias: int) -> int:
        return address - bias
