"""``ccprofctl``: the client of a running ccprofd daemon (gRPC on a Unix socket or TCP)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="ccprofctl",
        description="Query a running ccprofd daemon: targets, per-thread contexts, hot contexts, alerts.")
    parser.add_argument("--socket", default="/run/ccprofd/ccprofd.sock", help="daemon Unix socket")
    parser.parse_args(argv)
    print("ccprofctl: the ccprofd daemon and its gRPC service are not implemented in this version yet",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
