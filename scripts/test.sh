#!/usr/bin/env bash
# Installs the environment (scripts/setup.sh) and runs the whole test suite on CPU.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh tests/models -k parity   # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The two-node test (tests/trainer/test_two_nodes.py) builds network namespaces with iproute2's `ip`
# (root only; without it that test is skipped and says why).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[test] installing iproute2 (network namespaces of the two-node Ray test)"
  { apt-get install -y -q iproute2 || { apt-get update -q && apt-get install -y -q iproute2; }; } >/dev/null \
    || echo "[test] WARNING: iproute2 not installed; the two-node test will be skipped"
fi
exec .venv/bin/python -m pytest "${@:-tests}"
