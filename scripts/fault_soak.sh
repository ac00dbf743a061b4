#!/usr/bin/env bash
# Fault soak: kill a short `megarl train` run (SIGKILL of the driver's process group) at N random
# moments (start-up, mid-step, mid-checkpoint, mid-pruning, mid-metrics rewrite, mid-export, plus
# damaged checkpoints / metrics after a kill), rerun it each time, and compare every non-timing
# metric with the uninterrupted run; no process of the run may outlive a kill. Prints a table.
#
#   bash scripts/fault_soak.sh            # the full 20 points (~25 min on a busy 2-core machine)
#   bash scripts/fault_soak.sh 5 --seed 7 --root /tmp/soak
#
# The test suite runs 3 random points (tests/trainer/test_fault_soak.py). Exit status 0 = all good.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MEGARL_PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || command -v python3)}
POINTS=${1:-20}
shift || true
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec "$PY" -m megarl.trainer.fault_soak --points "$POINTS" "$@"
