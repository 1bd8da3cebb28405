#!/usr/bin/env bash
# Build ccprofd's compiled helpers (CPython extensions, each one C file beside the module that
# uses it) for the given Python (default .venv/bin/python).  Run by scripts/setup.sh; re-run it
# after changing a .c file.  Without them ccprofd falls back to its pure-Python code (same
# output, slower: README, PERFORMANCE, "ccprofd trace throughput").
#
#   bash scripts/build_ext.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
CC=${CC:-gcc}
INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if [ ! -e "$INC/Python.h" ]; then
  echo "build_ext: no Python.h in $INC (Debian: apt-get install python3-dev)" >&2; exit 1
fi
for src in ccprofd/export/cjsonl.c ccprofd/tracing/unwind/chits.c ccprofd/decode/cvalence.c \
    ccprofd/callgraph/csweep.c; do
  out=${src%.c}$SUFFIX
  tmp=$out.tmp.$$
  "$CC" -O2 -g -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden -I"$INC" -o "$tmp" "$src"
  mv -f "$tmp" "$out"  # atomically: a running ccprofd keeps the file it loaded
done
