#!/usr/bin/env bash
# The main job on the bundled example: build it, analyse its call graph, trace its syscalls.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p examples/build
gcc -O1 -g -o examples/build/demo examples/demo.c
echo "== ccprofd analyze --encoding all examples/build/demo"
ccprofd analyze --encoding all examples/build/demo
if ccprofd trace --help >/dev/null 2>&1; then
  echo
  echo "== ccprofd trace --syscalls write,openat -- examples/build/demo"
  ccprofd trace --syscalls write,openat -- examples/build/demo
fi
