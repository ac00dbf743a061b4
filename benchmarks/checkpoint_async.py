#!/usr/bin/env python
"""Benchmark: how long a checkpoint holds training up, asynchronous (`trainer.checkpoint_async`) against
synchronous, in the same run.

    python benchmarks/checkpoint_async.py                       # CPU: ~50M-parameter Llama, DP2, 2 rounds
    python benchmarks/checkpoint_async.py --hidden 1024 --layers 8 --steps 3 --rounds 3

Two gloo ranks hold a DP2 (or `--tp 2`: TP2) actor (megatron-core GPTModel, distributed Adam) and, per
round, save it four ways, each followed by `--steps` actor updates and `finish_checkpoint()`:

  * synchronous — `save_checkpoint(path)`, megarl's default (the baseline);
  * asynchronous — `save_checkpoint(path, wait=False)` (`trainer.checkpoint_async`: the state copied where
    training would change it, the files written on a thread while the updates run; `finish_checkpoint`
    waits for them if they are not yet written, and publishes);
  * the same two with `reshardable=False` (`trainer.checkpoint_reshardable=false`: the distributed
    optimizer's state as each rank holds it, instead of gathered over the DP ranks).

Prints, as medians over the rounds: the seconds each save held training up (the save call, and the wait at
`finish_checkpoint`), an update's seconds alone and after each save, and the ratio of each case to the
baseline, of the time held up and of the whole sequence (save + updates + finish). Each checkpoint written is loaded back into a fresh actor and must give
the saved weights exactly.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megarl.testing.models import save_tiny_hf_model


def actor_on_rank(hf_path: str, tp: int):
    from megarl.engine.config import EngineConfig, OptimConfig
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups, init_global_state
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    layout = ParallelLayout(tp=tp)
    groups = build_role_groups(layout)
    init_global_state(groups)
    config = EngineConfig(layout=layout, micro_batch_tokens=4096, optim=OptimConfig(lr=1e-4))
    return Actor(MegatronEngine(hf_path, config, groups))


def weights(actor) -> dict:
    return {name: tensor.clone() for name, tensor in actor.engine.hf_weights()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


MODES = {
    "synchronous": {"wait": True, "reshardable": True},
    "asynchronous": {"wait": False, "reshardable": True},
    "synchronous, DP-sharded": {"wait": True, "reshardable": False},
    "asynchronous, DP-sharded": {"wait": False, "reshardable": False},
}
"""The save of each case: megarl's default first (the baseline), then `trainer.checkpoint_async` and
`trainer.checkpoint_reshardable=false`, alone and together."""


def one_round(actor, batch, path: str, steps: int, wait: bool, reshardable: bool) -> dict:
    """Save, `steps` updates, finish: the seconds each part held training up."""
    saved = weights(actor)
    held = timed(lambda: actor.engine.save_checkpoint(path, wait=wait, reshardable=reshardable))
    updates = [timed(lambda: actor.update(batch)) for _ in range(steps)]
    finish_wait = timed(lambda: actor.engine.finish_checkpoint(wait=True))
    total = held + sum(updates) + finish_wait
    return {"held": held, "finish_wait": finish_wait, "updates": updates, "total": total, "saved": saved}


def bench_rank(hf_path: str, root: str, batch, args) -> dict:
    import torch.distributed as dist

    actor = actor_on_rank(hf_path, args.tp)
    actor.update(batch)  # warm-up (optimizer state exists from here on)
    alone = [timed(lambda: actor.update(batch)) for _ in range(args.steps)]
    results: dict[str, list] = {mode: [] for mode in MODES}
    size = 0
    for i in range(args.rounds):
        for mode, save in MODES.items():
            path = f"{root}/round{i}_{mode.replace(', ', '_')}"
            results[mode].append(one_round(actor, batch, path, args.steps, **save))
            check_loads(hf_path, args.tp, path, results[mode][-1].pop("saved"))
            dist.barrier()
            if dist.get_rank() == 0:
                size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
                shutil.rmtree(path)
    return {"alone": alone, "bytes": size, **results}


def check_loads(hf_path: str, tp: int, path: str, saved: dict) -> None:
    """The checkpoint holds the weights of the moment it was saved (not those the updates wrote meanwhile)."""
    fresh = actor_on_rank(hf_path, tp)
    fresh.engine.load_checkpoint(path)
    loaded = weights(fresh)
    if loaded.keys() != saved.keys() or not all(torch.equal(loaded[k], saved[k]) for k in saved):
        raise SystemExit(f"{path}: the loaded weights differ from those at the save")


def synthetic_batch(rows: int, tokens: int, vocab: int):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from train_step import synthetic_batch as batch_of

    return batch_of(rows, tokens // 4, tokens - tokens // 4, vocab)


def report(result: dict) -> dict:
    median = statistics.median
    print(f"checkpoint: {result['bytes'] / 2**20:.0f} MiB per save (every rank's files)")
    print(f"update alone: {median(result['alone']):.2f} s")
    held, total = {}, {}
    for mode in MODES:
        rows = result[mode]
        held[mode] = median(r["held"] + r["finish_wait"] for r in rows)
        total[mode] = median(r["total"] for r in rows)
        during = median(u for r in rows for u in r["updates"])
        each = ", ".join(f"{r['held']:.2f}" for r in rows)
        print(
            f"{mode:25s} held training up {held[mode]:6.2f} s (the save {median(r['held'] for r in rows):.2f},"
            f" waiting at finish {median(r['finish_wait'] for r in rows):.2f}), an update {during:.2f} s,"
            f" save + updates + finish {total[mode]:6.2f} s   [{each}]"
        )
    base = "synchronous"
    ratios = {mode: held[mode] / held[base] for mode in MODES if mode != base}
    for mode, ratio in ratios.items():
        print(
            f"ratio {mode} / {base}: time training was held up {ratio:.2f}x, save + updates + finish"
            f" {total[mode] / total[base]:.2f}x"
        )
    return ratios


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8, help="rows per update (both ranks)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row")
    parser.add_argument("--steps", type=int, default=2, help="updates after each save")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="1: DP2 (the quickstart's layout); 2: TP2")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    args = parser.parse_args(argv)
    from megarl.utils.distributed import run_distributed

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        hf_path = Path(tmp) / "llama"
        model = save_tiny_hf_model(
            "llama",
            hf_path,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=4 * args.hidden,
            vocab_size=args.vocab,
        )
        params = sum(p.numel() for p in model.parameters())
        layout = "DP2" if args.tp == 1 else "TP2"
        print(f"Llama {params / 1e6:.0f}M parameters, {layout} on 2 gloo ranks, fp32 + distributed Adam", flush=True)
        batch = synthetic_batch(args.rows, args.tokens, args.vocab)
        result = run_distributed(bench_rank, 2, str(hf_path), tmp, batch, args, num_threads=1, timeout=3600)[0]
        return report(result)


if __name__ == "__main__":
    main()
