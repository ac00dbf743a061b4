"""Named cluster scenarios for `megarl simulate --preset NAME`, with the assumptions behind their constants.

`7b-64gpu` (and `7b-64gpu-tp2`): a 7B dense model (Qwen2.5-7B: 7.6e9 parameters, 28 layers, GQA with
4 KV heads of 128) trained with GRPO on 64 H100s, 32 of them running rollout engines, 32 training.
These are ASSUMPTIONS, not measurements on such a cluster:
* decode at TP1: a decode step reads the 15.2 GB of bf16 weights once (~7 ms at ~2.2 TB/s achieved of
  the H100's 3.35 TB/s) and, per running sequence, its KV cache (57 KB/token; ~6k tokens of context ->
  ~0.35 GB, ~0.13 ms) plus ~15 GFLOP of matmuls (~0.03 ms): base 7 ms + 0.15 ms per sequence, i.e. ~4.9k
  tokens/s per GPU at 128 sequences. At TP2 (an engine on 2 GPUs): base 4.5 ms (half the weights per GPU
  plus two all-reduces per layer) + 0.08 ms per sequence.
* up to 128 sequences per TP1 engine (KV cache of ~60 GB at ~6k tokens each), 256 per TP2 engine.
* responses: lognormal, median 3,000 tokens, sigma 1.0, clipped at 16,384 (mean ~4.6k, ~4.5% clipped):
  the long tail of long chain-of-thought math; prompts ~500 tokens.
* batch: 128 prompts x 16 samples = 2,048 samples per update.
* training: 10 * N FLOPs per token (6N actor forward+backward, 2N old log-probs, 2N reference), attention
  left out, at 35% MFU of the H100's 989 dense bf16 TFLOP/s over the 32 training GPUs.
* weight sync: 5 s per update (15 GB broadcast from the trainer to 32 engines plus pause/resume).
Published speed-ups of asynchronous over synchronous training, for comparison (their baselines are
synchronous systems that colocate rollout and training on all GPUs; see `SimConfig.colocated`):
AReaL up to 2.77x (arXiv 2505.24298), verl's fully-async trainer 2.35-2.67x (verl recipe fully_async_policy).

Pure Python; imports nothing from megarl outside this package.
"""

from __future__ import annotations

from megarl.utils.simulate.model import Costs, Decode, Layout, Lengths, SimConfig

PARAMS_7B = 7.6e9
H100_BF16_TFLOPS = 989.0
PUBLISHED = {"AReaL (up to)": 2.77, "verl fully-async (low)": 2.35, "verl fully-async (high)": 2.67}


def train_s_per_sample(
    params: float,
    tokens_per_sample: float,
    gpus: int,
    mfu: float = 0.35,
    peak_tflops: float = H100_BF16_TFLOPS,
    flops_per_param_token: float = 10.0,
) -> float:
    """Seconds of trainer work per sample from FLOPs: flops_per_param_token * N * tokens at `mfu` of the peak."""
    return flops_per_param_token * params * tokens_per_sample / (gpus * peak_tflops * 1e12 * mfu)


def _seven_b(tp: int) -> SimConfig:
    lengths = Lengths(median=3000, sigma=1.0, max_tokens=16384)
    decode = Decode(base_s=0.007, per_seq_s=0.00015) if tp == 1 else Decode(base_s=0.0045, per_seq_s=0.00008)
    layout = Layout(rollout_gpus=32, train_gpus=32, engine_tp=tp, max_seqs_per_engine=128 * tp)
    train = train_s_per_sample(PARAMS_7B, 500 + lengths.mean(), layout.train_gpus)
    return SimConfig(
        layout=layout,
        lengths=lengths,
        decode=decode,
        costs=Costs(train, 5.0),
        prompts_per_step=128,
        samples_per_prompt=16,
        steps=12,
        warmup_steps=2,
        name=f"7B on 64 H100 (32 rollout, TP{tp})",
    )


PRESETS = {"7b-64gpu": lambda: _seven_b(1), "7b-64gpu-tp2": lambda: _seven_b(2)}


def preset(name: str) -> SimConfig:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: unknown; choose from {sorted(PRESETS)}")
    return PRESETS[name]()
