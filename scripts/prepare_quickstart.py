#!/usr/bin/env python
"""Everything the quickstarts train on, built locally in about a minute on one core (no download):

    python scripts/prepare_quickstart.py --model runs/quickstart/model --data data/arithmetic [--seed 0]

1. the character-level tokenizer and a tiny Qwen2 (2 layers, hidden 128, 4 heads of 32) from a config;
2. the task: sums of three digits ("3+5+8=" → "16"; 1,000 distinct problems) as raw-prompt parquet
   files: `test` holds 200 distinct problems, `train` 4,000 rows of the other 800;
3. an SFT warm-up (`megarl.trainer.sft`) on the train split's answers as written by a sloppy teacher
   who answers one too high 70% of the time. Imitation learns the sums and the habit together: the
   policy starts out mostly answering `sum + 1` (greedy test accuracy ~0.1-0.2) although it gives the
   right sum in about a third of its samples, so most GRPO groups have reward variance. The reward
   (exact answer) is what tells the two apart: RL removes the habit, imitation cannot.
The greedy test accuracy and the share of greedy answers off by one are printed.

A second run with the same arguments, code and libraries reuses the model and data when neither was
changed since (`megarl.utils.prepared`: a marker in the model directory; `--force` rebuilds).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = dict(num_operands=3, max_operand=9, chat=False)


def build_model(model_dir: Path, seed: int):
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_policy

    tok = build_tiny_tokenizer()
    if model_dir.exists():
        shutil.rmtree(model_dir)
    save_tiny_policy(
        model_dir, tok, seed=seed, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256
    )
    return tok


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/quickstart/model", help="where the tiny policy is written")
    parser.add_argument("--data", default="data/arithmetic", help="where train/test parquet files are written")
    parser.add_argument("--train-rows", type=int, default=4000, help="train rows (problems repeat)")
    parser.add_argument("--test-problems", type=int, default=200, help="distinct held-out problems")
    parser.add_argument("--sft-steps", type=int, default=800, help="warm-up steps (0: none)")
    parser.add_argument(
        "--teacher-error", type=float, default=0.7, help="share of warm-up answers off by one (0: a clean teacher)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model init, data and warm-up")
    parser.add_argument("--force", action="store_true", help="rebuild even when the last build is current")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from megarl.utils.prepared import MARKER, PreparedCache

    cache = PreparedCache(Path(args.model) / MARKER, script=__file__, args=args, inputs=[REPO / "megarl"])
    if (reused := cache.reuse(args.force)) is not None:
        return reused
    import torch

    from megarl.data.datasets import load_rows
    from megarl.data.tasks import write_task_splits
    from megarl.trainer.sft import greedy_answers, off_by_one_teacher, sft_examples, sft_warmup, warmup_threads

    torch.set_num_threads(warmup_threads())

    start = time.perf_counter()
    tok = build_model(Path(args.model), args.seed)
    n = args.train_rows + args.test_problems
    paths = write_task_splits(
        "arithmetic", n, args.data, seed=args.seed, test_fraction=args.test_problems / n, holdout="problems", **TASK
    )
    train_rows, test_rows = (load_rows(paths[split])[0] for split in ("train", "test"))
    train = sft_examples(off_by_one_teacher(train_rows, args.teacher_error, seed=args.seed), tok)
    losses = (
        sft_warmup(args.model, train, steps=args.sft_steps, batch_size=128, lr=3e-3, seed=args.seed, lr_decay=True)
        if args.sft_steps
        else []
    )
    test = sft_examples(test_rows, tok)
    answers = [tok.decode(a, skip_special_tokens=True) for a in greedy_answers(args.model, test)]
    accuracy = sum(a == r["ground_truth"] for a, r in zip(answers, test_rows)) / len(test_rows)
    off_by_one = sum(a == str(int(r["ground_truth"]) + 1) for a, r in zip(answers, test_rows)) / len(test_rows)
    loss = f", final loss {losses[-1]:.3f}" if losses else ""
    summary = (
        f"tiny Qwen2 at {args.model}, data at {args.data}; SFT warm-up {args.sft_steps} steps{loss};"
        f" greedy test accuracy {accuracy:.2f}, answers off by one {off_by_one:.2f}"
    )
    print(f"[prepare] {summary} ({time.perf_counter() - start:.0f} s)", flush=True)
    results = {"model": args.model, **paths, "sft_accuracy": accuracy, "sft_off_by_one": off_by_one}
    cache.save(results, summary, outputs=[Path(args.model), *map(Path, paths.values())])
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
