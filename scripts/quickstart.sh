#!/usr/bin/env bash
# The newcomer's first command: installs megarl, then trains a tiny Qwen2 with GRPO on CPU until its
# validation reward clearly climbs (a few minutes on 2 cores), and shows where the reward plot is.
#
#   bash scripts/quickstart.sh [RUN_DIR] [dotted.overrides ...]     (RUN_DIR: runs/grpo_quickstart)
#
# Steps: setup (.venv; idempotent) → tiny model + tokenizer + arithmetic task + short SFT warm-up
# (scripts/prepare_quickstart.py) → `megarl train --config configs/grpo_quickstart.yaml` through Ray
# with two CPU worker processes (TP2 actor, one vLLM CPU engine each) → validation before/after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RUN_DIR=${1:-runs/grpo_quickstart}
shift || true
PY=.venv/bin/python
"$PY" scripts/prepare_quickstart.py --model runs/quickstart/model --data data/arithmetic
rm -rf "$RUN_DIR"  # a fresh run each time (trainer.resume=auto would continue the previous one)
start=$(date +%s)
"$PY" -m megarl.cli train --config configs/grpo_quickstart.yaml trainer.run_dir="$RUN_DIR" "$@"
echo "[quickstart] train took $(( $(date +%s) - start )) s"
echo "[quickstart] metrics: $RUN_DIR/metrics.jsonl  TensorBoard: $PY -m tensorboard.main --logdir $RUN_DIR/tensorboard"
echo "[quickstart] reward curve: $RUN_DIR/reward_curve.png  samples: $RUN_DIR/rollouts/"
