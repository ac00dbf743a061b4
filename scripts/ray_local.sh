#!/usr/bin/env bash
# A persistent single-machine Ray cluster, for runs that should outlive the driver or share a
# dashboard (by default `megarl train` starts and stops its own local Ray instead).
#
#   bash scripts/ray_local.sh start [NUM_GPUS]    # GPUs default: what nvidia-smi sees (0 on CPU)
#   megarl train --config configs/grpo_quickstart.yaml resources.ray_address=127.0.0.1:6379
#   bash scripts/ray_local.sh status | stop
#
# Env knobs: MEGARL_RAY_PORT (6379), MEGARL_RAY_CPUS (all cores), MEGARL_PYTHON_BIN (.venv/bin if present).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${MEGARL_RAY_PORT:-6379}
BIN=${MEGARL_PYTHON_BIN:-$([[ -x .venv/bin/ray ]] && echo .venv/bin || dirname "$(command -v ray)")}
RAY="$BIN/ray"

case "${1:-}" in
  start)
    gpus=${2:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
    "$RAY" start --head --node-ip-address=127.0.0.1 --port="$PORT" --num-cpus="${MEGARL_RAY_CPUS:-$(nproc)}" \
      --num-gpus="$gpus" --include-dashboard=true --dashboard-host=127.0.0.1
    echo "ray_local: running at 127.0.0.1:$PORT; pass resources.ray_address=127.0.0.1:$PORT to megarl train"
    ;;
  status) "$RAY" status --address="127.0.0.1:$PORT" ;;
  stop) "$RAY" stop ;;
  *) echo "usage: $0 start [NUM_GPUS] | status | stop" >&2; exit 2 ;;
esac
