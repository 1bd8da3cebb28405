#!/usr/bin/env bash
# The whole test suite: set-up check (idempotent, fast when done), ruff, mypy, pytest.
# Run as root (BPF tests attach real probes). With CI=true, BPF tests that would skip fail instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-demo
.venv/bin/ruff check --output-format concise ccprofd tests bench
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
