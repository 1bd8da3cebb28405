#!/usr/bin/env bash
# One-command set-up of ccprofd on Debian 12 (run as root).  Idempotent and fast on re-runs.
#
#   bash scripts/setup.sh            install everything, then run the demo on the bundled example
#   bash scripts/setup.sh --no-demo  install everything only (the test command uses this)
#
# What it does: installs the system packages (bcc, kernel headers, toolchain, strace/gdb used as
# independent oracles by the tests), applies the kernel-headers fallback when the running kernel
# has none, mounts tracefs/debugfs/bpffs when missing, creates .venv with the project and a
# bcc-only bridge onto Debian's python3-bpfcc, links ccprofd/ccprofctl into /usr/local/bin and
# installs their bash completion (/usr/share/bash-completion/completions) and man pages
# (/usr/local/share/man: ccprofd(8), ccprofctl(1)).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEMO=1
[ "${1:-}" = "--no-demo" ] && DEMO=0

say() { printf 'setup: %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  say "must run as root (BPF, apt-get and /usr/local/bin need it)"; exit 2
fi

# ---- 1. system packages ---------------------------------------------------------------------------
# libc6-dbg: libc's separate debug file (symbols and source lines of library frames, tests/test_debugfile.py
# and tests/test_symbolize_debug.py)
# prometheus: its promtool checks the /metrics exposition in tests/test_export_metrics.py
# golang-go: `go tool pprof` reads the daemon's pprof endpoints in tests/test_export_pprof.py
# man-db, groff-base: `man ccprofd` (and the man-page test); bash-completion: loads the completions
# python3-dev: Python.h, for ccprofd's compiled helpers (scripts/build_ext.sh)
# redis-server, redis-tools: a real service in tests/test_services_redis_anomaly.py and test_services_redis_enforce.py (issue 14)
# nginx-light: a real service in tests/test_services_nginx_exact.py (its frames against gdb, issue 14)
# delve: Go's debugger, the oracle of Go scheduler stacks in tests/test_unwind_go.py
# linux-perf: tests/test_perf_coexistence.py (perf still counts the events ccprofd attaches to)
APT_PACKAGES=(python3-bpfcc linux-headers-amd64 bpftool gcc g++ make binutils strace gdb file
              python3 python3-venv python3-dev systemd prometheus libc6-dbg golang-go man-db groff-base
              bash-completion redis-server redis-tools nginx-light delve linux-perf)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Only promtool is wanted: stop the Prometheus server the package enables, if we installed it.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
  # The test starts its own redis-server on a free loopback port: stop the one the package enables.
  if [[ " ${missing[*]} " == *" redis-server "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now redis-server.service >/dev/null 2>&1 || true
  fi
  # Likewise nginx (the test starts its own master and worker).
  if [[ " ${missing[*]} " == *" nginx-light "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now nginx.service >/dev/null 2>&1 || true
  fi
fi

# ---- 2. kernel headers fallback (bcc compiles against /lib/modules/$(uname -r)/build) --------------
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build" ]; then
  HDR=$(ls -d /lib/modules/*-amd64 2>/dev/null | grep -v "/$KREL\$" | sort -V | tail -n 1 || true)
  if [ -z "$HDR" ] || [ ! -e "$HDR/build" ]; then
    say "no kernel headers for $KREL and no Debian headers to fall back on"; exit 1
  fi
  if [ -d "/lib/modules/$KREL" ] && [ ! -L "/lib/modules/$KREL" ]; then
    ln -sfn "$(readlink -f "$HDR/build")" "/lib/modules/$KREL/build"
    ln -sfn "$(readlink -f "$HDR/source")" "/lib/modules/$KREL/source"
  else
    ln -sfn "$HDR" "/lib/modules/$KREL"
  fi
  say "WARNING: no kernel headers for running kernel $KREL; pointed /lib/modules/$KREL at" \
      "$(basename "$HDR") headers (enough for uprobe/tracepoint programs: struct pt_regs, basic types)"
fi

# ---- 3. kernel filesystems ------------------------------------------------------------------------
mountpoint -q /sys/kernel/tracing 2>/dev/null || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
mountpoint -q /sys/kernel/debug 2>/dev/null || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
mountpoint -q /sys/fs/bpf 2>/dev/null || mount -t bpf bpf /sys/fs/bpf 2>/dev/null || true

# ---- 4. virtual environment -----------------------------------------------------------------------
PY=""
for cand in python3.11 python3 /usr/bin/python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    PY=$(command -v "$cand"); break
  fi
done
[ -n "$PY" ] || { say "no Python >= 3.11 with the venv module found"; exit 1; }
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  say "creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi
# bcc bridge: a directory holding only a symlink to Debian's bcc package, put on sys.path by a .pth
# file, so `import bcc` works without pulling in Debian's other site-packages.
BCC_SRC=/usr/lib/python3/dist-packages/bcc
[ -d "$BCC_SRC" ] || { say "python3-bpfcc did not install $BCC_SRC"; exit 1; }
mkdir -p .venv/bcc-bridge
ln -sfn "$BCC_SRC" .venv/bcc-bridge/bcc
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/.venv/bcc-bridge" > "$SITE/ccprofd-bcc-bridge.pth"

STAMP=.venv/.ccprofd-installed
HASH=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  say "installing ccprofd and its Python dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[dev,bench]"
  echo "$HASH" > "$STAMP"
fi
.venv/bin/python -c 'import bcc' || { say "import bcc failed inside .venv"; exit 1; }
if [ -f scripts/gen_proto.sh ]; then bash scripts/gen_proto.sh; fi
# The compiled helpers (the JSONL formatter of `ccprofd trace`): without them ccprofd runs its
# pure-Python code, slower, and says so; CI (CI=true) fails its tests instead.
bash scripts/build_ext.sh .venv/bin/python || say "warning: building the compiled helpers failed (ccprofd falls back to pure Python)"

# CCPROFD_SKIP_LINKS=1 leaves /usr/local/bin alone (a second checkout beside an installed one).
if [ "${CCPROFD_SKIP_LINKS:-0}" != 1 ]; then
  ln -sfn "$ROOT/.venv/bin/ccprofd" /usr/local/bin/ccprofd
  ln -sfn "$ROOT/.venv/bin/ccprofctl" /usr/local/bin/ccprofctl
  # Bash completion and man pages, generated from the commands' own argparse parsers (they cannot
  # drift from the installed version): bash-completion loads completions/NAME on first use.
  # Writes /usr/share/bash-completion/completions/{ccprofd,ccprofctl},
  # /usr/local/share/man/man8/ccprofd.8 and /usr/local/share/man/man1/ccprofctl.1.
  .venv/bin/python -m ccprofd.cli.docgen install --root / >/dev/null
fi
# Members of the ccprofd group run ccprofctl as themselves: a checkout (or Python) under a 0700
# home is out of their reach (README: "ccprofctl for the ccprofd group").
PROBLEM=$(.venv/bin/python -c 'import sys; from ccprofd.cli.daemon import access_problem as a; print(a(sys.argv[1]) or "")' \
          "$ROOT/.venv/bin/ccprofctl")
[ -z "$PROBLEM" ] || say "warning: other users cannot run $ROOT/.venv/bin/ccprofctl: $PROBLEM (see the README, \"ccprofctl for the ccprofd group\")"
# The BPF programs of `ccprofd trace` for small targets, compiled now rather than at the first trace
# (clang takes 5-9 s; issue 16's cold start-up target is 1.5 s).  CCPROFD_SKIP_PREBUILD=1 skips it.
if [ "${CCPROFD_SKIP_PREBUILD:-0}" != 1 ]; then
  bash scripts/prebuild_bpf.sh || say "warning: prebuilding the BPF objects failed (the first trace compiles them)"
fi
say "ready: $ROOT/.venv/bin/ccprofd, $ROOT/.venv/bin/ccprofctl"

# ---- 5. the main job on the bundled example --------------------------------------------------------
if [ "$DEMO" = 1 ]; then
  bash scripts/demo.sh
fi
