#!/usr/bin/env bash
# Benchmark set-up (run by `make bench`, as root): the Debian packages of the benchmark subjects that
# the main set-up does not install (sqlite3 and lua5.4 CLIs, bcc's tools), and the bench extra (matplotlib) in
# .venv.  Idempotent; does nothing when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'bench/setup: %s\n' "$*" >&2; }

# bpfcc-tools: syscount, bench/daemon.py's baseline; redis-server/redis-tools and linux-perf:
# nginx-light/apache2-utils, postgresql-15 (postgres, initdb, pgbench; bench/services.py starts its own
# throwaway cluster, the package's default one is not used): bench/services.py (the services under load
# and perf record --call-graph dwarf beside ccprofd)
PACKAGES=(sqlite3 lua5.4 strace bpftool bpfcc-tools redis-server redis-tools nginx-light apache2-utils linux-perf
          postgresql-15)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    say "missing packages ${missing[*]} and not root: install them (apt-get install ${missing[*]})"; exit 2
  fi
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! .venv/bin/python -c 'import matplotlib' 2>/dev/null; then
  say "installing the bench extra (matplotlib) into .venv"
  .venv/bin/pip install -q -e '.[bench]'
fi
