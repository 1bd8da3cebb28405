"""ccprofd/proc/vdso.py, the vDSO as a module (shared by unwind mode and thread snapshots), on this
very process: the image it keeps is the one the kernel maps (its base from ``getauxval(AT_SYSINFO_EHDR)``,
not from /proc/PID/maps), an ELF shared object with an ``.eh_frame`` as ``readelf`` reads it, and its
load bias the one readelf's program headers give.  The end-to-end checks that frames in the vDSO
equal gdb's are tests/test_unwind_vdso.py (unwind mode) and tests/test_userstack.py (snapshots)."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from bpf_helpers import pt_loads
from conftest import require_tool, skip_or_fail

from ccprofd.elf.addrspace import AddressSpace
from ccprofd.elf.image import ElfImage
from ccprofd.proc.maps import module_mappings
from ccprofd.proc.vdso import VdsoImages

AT_SYSINFO_EHDR = 33  # include/uapi/linux/auxvec.h


def addrspace_of(path: str) -> AddressSpace | None:
    try:
        return ElfImage(path).addrspace
    except Exception:
        return None


def vdso_base() -> int:
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    libc.getauxval.argtypes = [ctypes.c_ulong]
    base = int(libc.getauxval(AT_SYSINFO_EHDR))
    if base == 0:
        skip_or_fail("this process has no vDSO (vdso=0 on the kernel command line?)")
    return base


def test_the_vdso_becomes_a_module_read_from_the_process(tmp_path: Path) -> None:
    base = vdso_base()
    maps = module_mappings(os.getpid(), addrspace_of)
    assert [m.start for m in maps.other_exec if m.path == "[vdso]"] == [base]
    images = VdsoImages(tmp_path / "vdso")
    out = images.with_vdso(maps, addrspace_of)
    (vdso,) = [m for m in out.mappings if m.path == "[vdso]"]
    assert not [m for m in out.other_exec if m.path == "[vdso]"]
    assert len(out.mappings) == len(maps.mappings) + 1 and out.find(base) == vdso
    image = Path(vdso.open_path)
    assert image.parent == tmp_path / "vdso"
    # the kernel's image, byte for byte (ctypes reads this process's own memory at the auxv base)
    data = image.read_bytes()
    assert data == ctypes.string_at(base, len(data)) and len(data) == vdso.end - vdso.start
    readelf = require_tool("readelf")
    header = subprocess.run([readelf, "-hSW", str(image)], check=True, capture_output=True, text=True).stdout
    assert "DYN (Shared object file)" in header and ".eh_frame" in header
    # load bias: the PT_LOAD at file offset 0 is mapped at the vDSO's base
    (first,) = [vaddr for vaddr, _, off in pt_loads(image) if off == 0]
    assert vdso.bias == base - first and vdso.vaddr(base) == first
    # the same image again: the same file, none written twice
    assert images.with_vdso(module_mappings(os.getpid(), addrspace_of), addrspace_of).find(base) == vdso
    assert [p.name for p in (tmp_path / "vdso").iterdir()] == [image.name]


def test_unwritable_cache_directory_gives_a_private_copy_removed_at_close(tmp_path: Path) -> None:
    base = vdso_base()
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    images = VdsoImages(blocker / "vdso")
    maps = images.with_vdso(module_mappings(os.getpid(), addrspace_of), addrspace_of)
    vdso = maps.find(base)
    assert vdso is not None and vdso.path == "[vdso]"
    copy = Path(vdso.open_path)
    assert copy.exists() and not str(copy).startswith(str(tmp_path))
    images.close()
    assert not copy.exists()


def test_unreadable_image_leaves_the_maps_unchanged(tmp_path: Path) -> None:
    images = VdsoImages(tmp_path / "vdso")
    base = vdso_base()
    assert images.image(os.getpid(), base, base) is None  # empty range
    assert images.image(2**22 + 12345, base, base + 0x2000) is None  # no such process
    # a [vdso] entry of a process that is not this one: its memory is not there -> unchanged maps
    maps = module_mappings(os.getpid(), addrspace_of)
    unrelated = VdsoImages(tmp_path / "other")
    assert unrelated.with_vdso(maps, addrspace_of, proc_root=str(tmp_path)) is maps
    assert not (tmp_path / "other").exists()
