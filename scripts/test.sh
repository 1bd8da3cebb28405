#!/usr/bin/env bash
# The whole test suite: set-up check (idempotent, fast when done), ruff, mypy, pytest.
# Run as root (BPF tests attach real probes). With CI=true, BPF tests that would skip fail instead.
# Every check runs even when an earlier one fails, so one report shows all that is wrong.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-demo || exit 1
status=0
.venv/bin/ruff check --output-format concise ccprofd tests bench || status=1
.venv/bin/mypy || status=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" || status=1
exit $status
