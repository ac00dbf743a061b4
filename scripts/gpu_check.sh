#!/usr/bin/env bash
# The checks a CPU machine cannot make, on one CUDA GPU with CUDA torch and transformers already
# installed (no vLLM and no Transformer Engine needed: megarl builds megatron-core's local layer spec
# without TE). Each step runs on its own; a failing one does not stop the others.
#
#   bash scripts/gpu_check.sh            # from the repository root, ~4-6 min on an H100/H200
#   bash scripts/gpu_check.sh sync       # the weight sync's steps alone (5-7), ~4 min on an H200
#
# megarl is used from the checkout (PYTHONPATH), not installed. Wheels in .whl/ (for a machine without
# network: megatron-core's, and omegaconf's, which megarl.plan's package imports, with the antlr4 runtime it
# parses interpolations with) are installed into /tmp/site first:
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
# On an H200 (2026-11-28) step 2 printed MFU 29.1% vs transformers' 28.4% (26.5% on 2026-11-26, before the
# bf16 norms), log-probs as close to transformers' float32 ones as its bf16 ones, and a 35.2 GiB peak against
# 40.6 GiB predicted; step 4 logit parity 1.8e-7 and a bit-exact round trip; step 5 checksums at 1.46x of a
# copy, the check's share +26%, and every check passed (unverified syncs into mapped buffers included).
# What it runs:
#   1. benchmarks/train_step.py --quick: the actor's update on CUDA at all (NCCL, bf16, local spec);
#   2. the same at ~1.5 B parameters (Llama-3 vocabulary): tokens/s and MFU against transformers +
#      AdamW on the same rows, log-prob parity with transformers, and the first update's peak memory
#      against what `megarl plan` predicts for it;
#   3. benchmarks/logprob_memory.py on CUDA: the chunked vocab-parallel log-prob's peak memory and time
#      against the plain log_softmax + gather;
#   4. scripts/conversion_demo.py at TP1: logit parity with transformers (float32) of a model built on the
#      GPU, HF -> megatron-core distributed checkpoint -> HF, bit for bit;
#   5. benchmarks/ipc_device.py: the IPC weight transport over CUDA IPC handles into another process, 3 GB
#      of bf16 in 1 GB buckets: verified and unverified syncs bit-identical, a corrupted bucket refused
#      naming its tensor (by the channel's read-back sums and by the one-launch pack's own), and bytes/s against
#      a device copy (H200, 2026-11-28: the pack in one Triton launch a bucket 1.00x of a copy, a copy per tensor
#      0.46x; checksums 1.72x; the check's share of the sync +25.6% with the pack's sums, +30.4% read back;
#      since 2026-11-28 the engine compares a bucket's sums after queueing its copies, `ipc-check-first` the
#      form before: 2026-12-04, +19.5% against +31.4%).
#   6. benchmarks/sync_device.py: the colocated in-process sync (sharding manager -> an embedded engine on the
#      same GPU, which adopts the buckets) of a Qwen2-1.5B-sized Llama in bf16: bit-identical, the sleep giving
#      the adopted buffers back, every bucket's one-launch sums equal to a read-back, and bytes/s against a
#      device copy (H200, 2026-11-28: gather 3.55 ms, 0.48x, checksums included, against 4.75 / 6.37 ms for the
#      few-launch pack without / with them read back; 5.18 ms, 0.33x awake; 7.81 ms, 0.22x after a wake-up;
#      2026-12-04: 0.35x awake, and in 1 GiB buckets, the second run, 0.50x awake, 0.29x after a wake-up).
#   7. benchmarks/unpack_device.py: the rollout rank's unpack of TP-sharded buckets (TP 2, 4, 8 of the same
#      model, made up from random HF tensors on the GPU): bit-identical, its copy_ calls and bytes/s against a
#      device copy (2026-12-04, by the rules: 0.19x / 0.12x / 0.05x at TP 2 / 4 / 8, launch-bound; the one launch
#      a bucket, `unpack`, not yet run on a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {
    echo "== $*"
    local start=$SECONDS
    timeout 600 "$@" || { echo "!! exit $? after $((SECONDS - start)) s: $*"; status=1; }
    echo "-- $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)"
if [ "${1:-all}" != sync ]; then
    step "$PY" benchmarks/train_step.py --quick
    step "$PY" benchmarks/train_step.py --layers 16 --hidden 2048 --heads 16 --kv-heads 8 --vocab 128256 \
        --rows 16 --prompt 256 --response 768 --micro-batch-tokens 8192 --steps 3 --threads 8
    step "$PY" benchmarks/logprob_memory.py --tokens 8192 --vocab 151936 --device cuda --dtype bfloat16
    step "$PY" scripts/conversion_demo.py --out /tmp/megarl_gpu_conversion --tp 1 --pp 1
fi
step "$PY" benchmarks/unpack_device.py --repeats 5  # first: the one-launch unpack has not yet run on a GPU
step "$PY" benchmarks/ipc_device.py --bucket-mb 1024 --repeats 9
step "$PY" benchmarks/sync_device.py --repeats 5
step "$PY" benchmarks/sync_device.py --repeats 5 --bucket-mb 1024
exit $status
