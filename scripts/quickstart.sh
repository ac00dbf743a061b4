#!/usr/bin/env bash
# The newcomer's first command: installs megarl and runs the conversion + parity demo on CPU.
# (It becomes the GRPO training quickstart once the trainer lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/conversion_demo.py --out "${1:-runs/quickstart}"
