#!/usr/bin/env bash
# Compile ccprofd trace's BPF programs ahead of time (run by setup.sh, as root): traces a small C
# program once per variant (unwind mode; the text format, which joins return values, and JSONL,
# which does not: their programs differ in a ring buffer's size) with an empty cache and keeps
# the compiled objects and kernel-BTF offsets in DIR (default /var/cache/ccprofd/bpf-prebuilt, what
# ccprofd reads: kbpf/objcache.prebuilt_dir).  A first trace of another small program (tables within
# the smallest buckets, one 64-bit acycID word, no recursion) then needs no clang compile.  Objects
# depend on the kernel, libbcc and ccprofd's BPF text: re-run after upgrading any of them.
#
#   bash scripts/prebuild_bpf.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${CCPROFD_BPF_PREBUILT_DIR:-/var/cache/ccprofd/bpf-prebuilt}}
PY=${PYTHON:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
printf 'int main(void) { return 0; }\n' > "$TMP/small.c"
cc -O2 -o "$TMP/small" "$TMP/small.c"
mkdir -p "$DIR"
for extra in "--format text" "--format jsonl"; do
  # shellcheck disable=SC2086
  CCPROFD_CACHE_DIR="$TMP/cache" CCPROFD_BPF_PREBUILT_DIR="$DIR" \
    "$PY" -m ccprofd.cli trace $extra -o /dev/null -- "$TMP/small"
done
cp -r "$TMP/cache/bpf/." "$DIR/"
printf 'prebuild_bpf: compiled objects in %s\n' "$DIR" >&2
