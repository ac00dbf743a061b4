#!/usr/bin/env bash
# The tool-use quickstart: a tiny Qwen2 learns with GRPO, through the tool agent loop, that products
# like "964*59=" pay only when it asks the calculator (CPU, 2 worker processes).
#
#   bash scripts/tool_quickstart.sh [--seed N] [--rebuild] [RUN_DIR] [dotted.overrides ...]
#       --seed N  model init, data, warm-up and trainer seed (default 0)
#       --rebuild the model, data and warm-up again even when the last ones are current (same
#                 seed, code and libraries: they are reused, megarl.utils.prepared)
#       RUN_DIR   default runs/tool_quickstart
#
# Steps: setup (.venv; idempotent) → tiny model whose tokenizer renders tools compactly + the task
# (rows with agent_name: tool_agent) + an SFT warm-up: calls only until the copies are learned, then a
# mix where 20% of the demonstrations call the calculator and the rest guess
# (scripts/prepare_tool_quickstart.py) → `megarl train --config configs/tool_agent_quickstart.yaml` → validation (greedy accuracy, val/agent/tool_success) before/after.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=0
REBUILD=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) SEED=${2:?--seed needs a number}; shift 2 ;;
    --rebuild) REBUILD=(--force); shift ;;
    *) break ;;
  esac
done
RUN_DIR=${1:-runs/tool_quickstart}
shift || true
source scripts/run_dir.sh
check_run_dir "$RUN_DIR" runs/quickstart_tool/model data/tool_arithmetic  # before the set-up and the warm-up
bash scripts/setup.sh
PY=.venv/bin/python
"$PY" scripts/prepare_tool_quickstart.py --model runs/quickstart_tool/model --data data/tool_arithmetic --seed "$SEED" "${REBUILD[@]}"
rm -rf "$RUN_DIR"  # a fresh run each time
start=$(date +%s)
"$PY" -m megarl.cli train --config configs/tool_agent_quickstart.yaml trainer.run_dir="$RUN_DIR" \
  trainer.seed="$SEED" data.seed="$SEED" "$@"
echo "[tool quickstart] train took $(( $(date +%s) - start )) s"
echo "[tool quickstart] metrics: $RUN_DIR/metrics.jsonl (val/acc, val/agent/tool_success)  turns: $RUN_DIR/rollouts/"
