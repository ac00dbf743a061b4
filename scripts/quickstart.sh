#!/usr/bin/env bash
# The newcomer's first command: installs megarl, then trains a tiny Qwen2 with GRPO on CPU until its
# greedy validation accuracy clearly climbs (a 3-minute budget of training on 2 idle cores), and shows where
# the reward plot is.
#
#   bash scripts/quickstart.sh [--ppo] [--seed N] [--rebuild] [RUN_DIR] [dotted.overrides ...]
#       --ppo     PPO (GAE + critic, configs/ppo_quickstart.yaml) instead of GRPO
#       --seed N  model init, data, warm-up and trainer seed (default 0)
#       --rebuild the model, data and warm-up again even when the last ones are current (same
#                 seed, code and libraries: they are reused, megarl.utils.prepared)
#       RUN_DIR   default runs/grpo_quickstart (runs/ppo_quickstart with --ppo)
#
# Steps: setup (.venv; idempotent) → tiny model + tokenizer + task (sums of three digits, 200 held-out
# problems) + SFT warm-up on a sloppy teacher's answers (scripts/prepare_quickstart.py) →
# `megarl train --config configs/grpo_quickstart.yaml` through Ray with two CPU worker processes
# (DP2 actor, one vLLM CPU engine each; TP2 with --ppo) → validation before/after.
set -euo pipefail
cd "$(dirname "$0")/.."
ALGO=grpo
SEED=0
REBUILD=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ppo) ALGO=ppo; shift ;;
    --seed) SEED=${2:?--seed needs a number}; shift 2 ;;
    --rebuild) REBUILD=(--force); shift ;;
    *) break ;;
  esac
done
RUN_DIR=${1:-runs/${ALGO}_quickstart}
shift || true
source scripts/run_dir.sh
check_run_dir "$RUN_DIR" runs/quickstart/model data/arithmetic  # before the set-up and the warm-up
bash scripts/setup.sh
PY=.venv/bin/python
"$PY" scripts/prepare_quickstart.py --model runs/quickstart/model --data data/arithmetic --seed "$SEED" "${REBUILD[@]}"
rm -rf "$RUN_DIR"  # a fresh run each time (trainer.resume=auto would continue the previous one)
start=$(date +%s)
"$PY" -m megarl.cli train --config "configs/${ALGO}_quickstart.yaml" trainer.run_dir="$RUN_DIR" \
  trainer.seed="$SEED" data.seed="$SEED" "$@"
echo "[quickstart] train took $(( $(date +%s) - start )) s"
echo "[quickstart] metrics: $RUN_DIR/metrics.jsonl  TensorBoard: $PY -m tensorboard.main --logdir $RUN_DIR/tensorboard"
echo "[quickstart] reward curve: $RUN_DIR/reward_curve.png  samples: $RUN_DIR/rollouts/"
