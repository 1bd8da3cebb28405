"""Command-line entry points (``ccprofd``, ``ccprofctl``) and their usage errors."""
