#!/usr/bin/env python
"""Everything the GRPO quickstart trains on, built locally in seconds (no download):

    python scripts/prepare_quickstart.py --model runs/quickstart/model --data data/arithmetic

1. the character-level tokenizer and a tiny Qwen2 (2 layers, hidden 64, 2 heads of 32) from a config;
2. the arithmetic task ("3+4=" → "7", operands 0-4) as raw-prompt train/test parquet files;
3. a short SFT warm-up on reference answers (`megarl.trainer.sft`): it teaches the answer format
   (a number, then the end-of-turn token) and a little arithmetic, so RL starts from a policy that
   is sometimes right; its greedy test accuracy is printed. GRPO then has to do the rest.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path


def build_model(model_dir: Path, seed: int):
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_hf_model

    tok = build_tiny_tokenizer()
    if model_dir.exists():
        shutil.rmtree(model_dir)
    save_tiny_hf_model("qwen2", model_dir, seed=seed, vocab_size=len(tok), hidden_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=2, intermediate_size=128, tokenizer=tok,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/quickstart/model", help="where the tiny policy is written")
    parser.add_argument("--data", default="data/arithmetic", help="where train/test parquet files are written")
    parser.add_argument("--n", type=int, default=2000, help="problems in train + test")
    parser.add_argument("--sft-steps", type=int, default=350, help="warm-up steps (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from megarl.data.datasets import load_rows
    from megarl.data.tasks import write_task_splits
    from megarl.trainer.sft import greedy_accuracy, sft_examples, sft_warmup

    start = time.perf_counter()
    tok = build_model(Path(args.model), args.seed)
    paths = write_task_splits("arithmetic", args.n, args.data, seed=args.seed, chat=False)
    train, test = (sft_examples(load_rows(paths[split])[0], tok) for split in ("train", "test"))
    losses = sft_warmup(args.model, train, steps=args.sft_steps, seed=args.seed) if args.sft_steps else []
    accuracy = greedy_accuracy(args.model, test[:100])
    loss = f", final loss {losses[-1]:.3f}" if losses else ""
    print(f"[prepare] tiny Qwen2 at {args.model}, data at {args.data}; SFT warm-up {args.sft_steps} steps{loss};"
          f" greedy test accuracy {accuracy:.2f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {"model": args.model, **paths, "sft_accuracy": accuracy}


if __name__ == "__main__":
    main(sys.argv[1:])
