"""Benchmark: tokens/s (and MFU on CUDA) of an actor update through the Megatron engine, against a
plain `transformers` + AdamW step on the same rows in the same run.

    python benchmarks/train_step.py                         # CPU: 4 layers, hidden 256, 16 x 256 tokens
    python benchmarks/train_step.py --quick                 # tiny, seconds
    python benchmarks/train_step.py --hidden 2048 --layers 16 --heads 16 --kv-heads 8 --vocab 128256 \\
        --rows 16 --prompt 256 --response 768 --micro-batch-tokens 8192 --threads 8   # one GPU (bf16), ~1 min

megarl: `Actor.update` (PPO-clip, unpadded micro-batches packed by --micro-batch-tokens, vocab-parallel
log-probs and entropy, megatron DDP + distributed Adam) on `--tp` ranks. Baseline: the HF model on
the padded batch, `log_softmax` + gather, the entropy statistic, the same PPO-clip loss, AdamW. Both count real
(unpadded) tokens; they alternate step by step in one process (same machine load), one warm-up
step each, then the best of --steps. Prints tokens/s, the ratio megarl / baseline, and MFU (model FLOPs 6·N·T + causal attention, over the
GPU's dense bf16 peak) when CUDA is present. With megatron-core's local layer spec (no Transformer Engine:
CPU) the same actor also steps, alternated with the others, with its core attention on megatron's
unfused forward instead of torch's fused kernel (`megarl.models.attention.SdpaAttention`), and the ratio
of the two is printed.

    python benchmarks/train_step.py --layers 2 --hidden 128 --vocab 103 --rows 128 --prompt 16 --response 4 \
        --threads 1          # the GRPO quickstart's model and update shape (one rank's rows)

Checked once before timing: megarl's log-probs of the responses against transformers' (rank 0) in the
same dtype and, on CUDA, also against transformers in float32, printed beside transformers' own
bf16-vs-float32 difference (bf16 rounding sets the scale; float32 on CPU agrees to ~1e-6). On CUDA the
peak allocated memory of the actor's first update (its optimizer state included) is printed against
`megarl.plan.memory.role_memory`'s prediction for it.
"""

import argparse
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from megarl.data.batch import Batch
from megarl.models.flops import PEAK_BF16_TFLOPS, train_flops
from megarl.models.hf_config import describe_hf_config, load_hf_config
from megarl.testing.models import save_tiny_hf_model

ENGINE_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
"""megarl's engine dtype here (EngineConfig dtype "auto"), which the transformers baseline uses too."""


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> Batch:
    """Left-padded prompts of varying length + right-padded responses with PPO columns."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    response_mask = torch.zeros(rows, response, dtype=torch.long)
    for r in range(rows):
        p = prompt // 2 + int(torch.randint(0, prompt // 2 + 1, (1,), generator=gen))
        t = response // 2 + int(torch.randint(0, response // 2 + 1, (1,), generator=gen))
        mask[r, prompt - p : prompt + t] = 1
        response_mask[r, :t] = 1
    ids = torch.randint(3, vocab, mask.shape, generator=gen) * mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(rows, response, generator=gen) * 5,
            "advantages": torch.randn(rows, response, generator=gen),
        }
    )


def model_flops(hf_path, batch: Batch) -> float:
    """Forward + backward FLOPs of the update (`megarl.models.flops.train_flops`: 6·N·T + causal attention)."""
    return train_flops(describe_hf_config(load_hf_config(hf_path)), batch["attention_mask"].sum(-1))


def bench_rank(hf_path, batch: Batch, args):
    """Per rank: the actor at TP=args.tp and (rank 0) the transformers baseline, stepped alternately.

    Alternating the two, one step each, keeps them under the same machine load (the 2-core CI
    machines are shared); each side reports its best step after one warm-up step.
    """
    import torch.distributed as dist

    from megarl.models.attention import SdpaAttention

    reference = reference_log_probs(hf_path, batch) if dist.get_rank() == 0 else None
    actor = _actor(hf_path, args)
    checks = {"log_prob_diff": compare_log_probs(actor, batch, reference)}
    if torch.cuda.is_available():  # before the baseline's model shares the GPU
        checks["update_peak_bytes"] = update_peak_bytes(actor, batch)
    fused = [m for chunk in actor.engine.model for m in chunk.modules() if isinstance(m, SdpaAttention)]

    def megarl_step(fusable: bool):
        for module in fused:
            module.fusable = fusable
        actor.update(batch)

    steps = {"megarl": lambda: megarl_step(True)}
    if fused:  # the local spec: its attention's two paths, alternated like the rest
        steps["megarl, megatron's attention"] = lambda: megarl_step(False)
    steps["transformers"] = _hf_step_fn(hf_path, batch) if dist.get_rank() == 0 else (lambda: None)
    times = {name: [] for name in steps}
    for i in range(args.steps + 1):
        for name, step in steps.items():
            seconds = _timed(step)
            if i:  # step 0 warms up
                times[name].append(seconds)
        dist.barrier()
    return {name: {"seconds": min(t)} for name, t in times.items()} | checks


def reference_log_probs(hf_path, batch: Batch) -> dict:
    """transformers' log-probs of the responses: in the engine's dtype, and on CUDA also in float32."""
    reference = {"same dtype": _hf_log_probs_once(hf_path, batch, ENGINE_DTYPE)}
    if ENGINE_DTYPE != torch.float32:
        reference["float32"] = _hf_log_probs_once(hf_path, batch, torch.float32)
    return reference


def compare_log_probs(actor, batch: Batch, reference: Optional[dict]) -> Optional[dict]:
    """|Δ| (max, mean over response tokens) of megarl's log-probs against each transformers reference,
    and, on CUDA, of transformers' own bf16 log-probs against its float32 ones (the rounding scale)."""
    ours = actor.compute_log_probs(batch)["old_log_probs"].float().cpu()
    if reference is None:
        return None
    mask = batch["response_mask"].bool()

    def diff(a, b):
        d = (a - b).abs()[mask]
        return float(d.max()), float(d.mean())

    result = {f"megarl vs transformers {name}": diff(ours, ref) for name, ref in reference.items()}
    if "float32" in reference:
        result["transformers bf16 vs float32"] = diff(reference["same dtype"], reference["float32"])
    return result | {"tokens": int(mask.sum())}


def update_peak_bytes(actor, batch: Batch) -> int:
    """CUDA: peak allocated bytes during the actor's first update (optimizer state created in it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    actor.update(batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _actor(hf_path, args):
    from megarl.engine.config import EngineConfig, OptimConfig
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups, init_global_state
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    layout = ParallelLayout(tp=args.tp)
    groups = build_role_groups(layout)
    init_global_state(groups)
    config = EngineConfig(layout=layout, micro_batch_tokens=args.micro_batch_tokens, optim=OptimConfig(lr=1e-6))
    return Actor(MegatronEngine(hf_path, config, groups))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step) -> float:
    _sync()
    start = time.perf_counter()
    step()
    _sync()
    return time.perf_counter() - start


def _hf_model(hf_path, batch: Batch, dtype: torch.dtype = ENGINE_DTYPE):
    """The transformers model (by default in megarl's engine dtype) and the batch on its device."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).to(device)
    return model, {k: v.to(device) for k, v in batch.tensors.items()}


def _hf_log_probs_once(hf_path, batch: Batch, dtype: torch.dtype) -> torch.Tensor:
    """transformers' log-probs of the batch's responses [B, T] (float32, CPU); the model is freed after."""
    model, tensors = _hf_model(hf_path, batch, dtype)
    with torch.no_grad():
        log_probs = _hf_log_probs(model, tensors)[0].cpu()
    del model, tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return log_probs


def _hf_step_fn(hf_path, batch: Batch):
    """One update of the same rows with transformers on the padded batch and torch AdamW."""
    model, tensors = _hf_model(hf_path, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    return lambda: _hf_step(model, optimizer, tensors)


def _hf_log_probs(model, t) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the float32 response logits they come from."""
    response = t["response_mask"].shape[1]
    positions = (t["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(t["input_ids"], attention_mask=t["attention_mask"], position_ids=positions).logits
    logits = logits[:, -response - 1 : -1].float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, -response:].unsqueeze(-1)).squeeze(-1)
    return log_probs, logits


def _hf_step(model, optimizer, t):
    from megarl.algorithms import (
        LossAggregation,
        PolicyLossConfig,
        PolicyLossInputs,
        entropy_from_logits,
        get_policy_loss,
    )

    log_probs, logits = _hf_log_probs(model, t)
    with torch.no_grad():  # the entropy statistic every actor update reports (megarl's head computes it too)
        entropy_from_logits(logits)
    inputs = PolicyLossInputs(log_probs, t["old_log_probs"], t["advantages"], t["response_mask"])
    loss, _ = get_policy_loss("ppo_clip")(
        inputs, PolicyLossConfig(), LossAggregation.for_batch("token-mean", t["response_mask"])
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def report(args, hf_path, batch, ours, base, unfused=None) -> None:
    tokens = int(batch["attention_mask"].sum())
    print(
        f"model: {args.arch} layers={args.layers} hidden={args.hidden} vocab={args.vocab}; batch {args.rows} rows,"
        f" {tokens} real tokens of {batch['input_ids'].numel()} (padded); tp={args.tp} threads={args.threads}"
    )
    for name, result in (("megarl engine", ours), ("transformers ", base)):
        line = f"  {name}: {tokens / result['seconds']:10.0f} tokens/s  ({result['seconds'] * 1e3:.0f} ms/step)"
        if torch.cuda.is_available():
            line += f"  MFU {_mfu(hf_path, batch, result['seconds'], args):.1%}"
        print(line)
    print(f"  ratio megarl / transformers = {base['seconds'] / ours['seconds']:.2f}x tokens/s")
    if unfused is not None:
        print(
            f"  local-spec attention: fused {ours['seconds'] * 1e3:.1f} ms vs megatron's unfused"
            f" {unfused['seconds'] * 1e3:.1f} ms a step = {unfused['seconds'] / ours['seconds']:.3f}x tokens/s"
        )


def report_checks(args, hf_path, batch, result) -> None:
    """The log-prob parity line and, on CUDA, the first update's peak memory against `megarl.plan`."""
    diffs = dict(result["log_prob_diff"])
    tokens = diffs.pop("tokens")
    print(f"  log-probs over {tokens} response tokens (megarl in {str(ENGINE_DTYPE).removeprefix('torch.')}):")
    for name, (largest, mean) in diffs.items():
        print(f"    {name:34s} max |Δ| {largest:.2e}  mean |Δ| {mean:.2e}")
    if "update_peak_bytes" in result:
        predicted = predicted_update_memory(args, hf_path, batch)
        measured = result["update_peak_bytes"]
        parts = ", ".join(f"{k} {getattr(predicted, k) / 2**30:.2f}" for k in predicted.__dataclass_fields__)
        print(
            f"  first update's peak memory (rank 0): measured {measured / 2**30:.2f} GiB, megarl.plan predicts"
            f" {predicted.peak / 2**30:.2f} GiB ({parts}) = {predicted.peak / measured:.2f}x"
        )


def predicted_update_memory(args, hf_path, batch):
    """`megarl.plan.memory.role_memory` of this actor (bf16, no recompute, the largest micro-batch)."""
    from megarl.engine.config import EngineConfig
    from megarl.models.layout import ParallelLayout
    from megarl.models.spec import te_available
    from megarl.plan.memory import Shard, role_memory

    dims = describe_hf_config(load_hf_config(hf_path))
    layout = ParallelLayout(tp=args.tp)
    tokens = min(max(args.micro_batch_tokens, args.prompt + args.response), int(batch["attention_mask"].sum()))
    return role_memory(
        dims,
        Shard.of(layout, args.tp),
        trainable=True,
        recompute=False,
        tokens=tokens,
        chunk=EngineConfig().logprob_chunk_tokens,
        sp=te_available(),
    )


def _mfu(hf_path, batch, seconds, args) -> float:
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), float("nan"))
    return model_flops(hf_path, batch) / seconds / (peak * 1e12 * args.tp)


def main(args) -> None:
    from megarl.utils.distributed import run_distributed

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_path = Path(tmp) / args.arch
        save_tiny_hf_model(
            args.arch,
            hf_path,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=4 * args.hidden,
            vocab_size=args.vocab,
        )
        batch = synthetic_batch(args.rows, args.prompt, args.response, args.vocab)
        result = run_distributed(
            bench_rank, args.tp, str(hf_path), batch, args, num_threads=max(1, args.threads // args.tp)
        )[0]
        report(
            args, hf_path, batch, result["megarl"], result["transformers"], result.get("megarl, megatron's attention")
        )
        report_checks(args, hf_path, batch, result)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (
        ("layers", 4),
        ("hidden", 256),
        ("heads", 4),
        ("kv-heads", 2),
        ("vocab", 32000),
        ("rows", 16),
        ("prompt", 64),
        ("response", 192),
        ("micro-batch-tokens", 2048),
        ("steps", 3),
        ("tp", 1),
        ("threads", 2),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak (default: by name)")
    parser.add_argument("--quick", action="store_true", help="2 layers, hidden 64, 8 x 64 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.rows, args.prompt, args.response = 2, 64, 512, 8, 16, 48
    return args


if __name__ == "__main__":
    main(parse_args())
