"""``python -m ccprofd.kbpf.compile_worker``: compile one BPF C translation unit with bcc and print
its :class:`~ccprofd.kbpf.objcache.CompiledObject` as JSON.

Run as a child process by :func:`ccprofd.kbpf.objcache.compile_in_subprocess` so that libbcc (which
embeds LLVM) and clang's heap never map into the daemon or the tracer.  Input on stdin:
``{"text": ..., "cflags": [...]}``.  Exit 0 with the object on stdout; exit 1 with the one-line
:class:`BPFError` message as the last stdout line.
"""

from __future__ import annotations

import json
import os
import sys

from ccprofd.kbpf.errors import BPFError


def main() -> int:
    from ccprofd.kbpf.bcc_adapter import BccModule

    # The answer goes to the original stdout; anything bcc or clang print there goes to stderr.
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    with answer:
        try:
            request = json.loads(sys.stdin.buffer.read())
            text, cflags = str(request["text"]), [str(f) for f in request["cflags"]]
        except (ValueError, KeyError, TypeError) as exc:
            answer.write(f"bad compile request: {exc}\n".encode())
            return 1
        try:
            with BccModule(text, cflags) as mod:
                obj = mod.compiled_object()
        except BPFError as exc:
            answer.write(f"{exc}\n".encode())
            return 1
        answer.write(obj.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
