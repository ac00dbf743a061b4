#!/usr/bin/env bash
# Installs the environment (scripts/setup.sh) and runs the whole test suite on CPU.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh tests/models -k parity   # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "${@:-tests}"
