"""ELF objects as ccprofd reads them: image, address space, symbols, PLT, DT_NEEDED, and unwind tables."""
