#!/usr/bin/env python
"""Benchmark: the driver's work between generation and the update, per step, at the quickstart's shape
and at a long-response one, against a plain padded conversion of the same rows in the same run.

    python benchmarks/driver_batch.py                        # 256 x 4 tokens (quickstart), 512 x 1024
    python benchmarks/driver_batch.py --shapes 1024x4096     # samples x response tokens

Every sample is an engine completion (token ids, log-probs, versions); the driver turns them into
trajectories (`megarl.agent.single_turn.completion_trajectory`), the training batch
(`megarl.trainer.batching.trajectory_batch`), the response texts (`decode_responses`, the quickstart's
tokenizer), the rule rewards (`RewardRunner`, in-process, per-sample time limits) and the step's metrics
(`batch_metrics`). Each phase's median over --repeats is printed, and for the batch the ratio against
the baseline: the same five [B, T] columns (ids, mask, log-probs, versions, turn rewards) padded row by
row in Python and handed to `torch.tensor` as nested lists, the textbook way.
No Ray, no workers: the driver's own CPU time, on the critical path of every synchronous step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.agent.single_turn import completion_trajectory  # noqa: E402
from megarl.data.batch import Batch  # noqa: E402
from megarl.rewards.runner import RewardConfig, RewardRunner  # noqa: E402
from megarl.rollout.base import Completion  # noqa: E402
from megarl.trainer import batching  # noqa: E402
from megarl.trainer.metrics import batch_metrics  # noqa: E402

PROMPT_TOKENS, GROUP = 16, 8


def completions(samples: int, tokens: int, vocab: int, rng: random.Random) -> list[list[Completion]]:
    """`samples` completions of `tokens` each, in groups of GROUP per prompt."""
    return [
        [
            Completion(
                [rng.randrange(3, vocab) for _ in range(tokens)], [-rng.random() for _ in range(tokens)], "stop", 1
            )
            for _ in range(GROUP)
        ]
        for _ in range(samples // GROUP)
    ]


def prompts(groups: int, vocab: int) -> Batch:
    ids = torch.randint(3, vocab, (groups, PROMPT_TOKENS))
    return Batch.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        {"ground_truth": ["12"] * groups, "data_source": ["arithmetic"] * groups},
    )


def plain_columns(flat) -> list[torch.Tensor]:
    """The baseline: each column padded per row in Python, then one `torch.tensor` of the nested lists."""
    width = max(len(t.response_ids) for t in flat)

    def pad(rows, value, dtype):
        return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)

    return [
        pad([t.response_ids for t in flat], 0, torch.long),
        pad([t.response_mask for t in flat], 0, torch.long),
        pad([t.response_logprobs for t in flat], 0.0, torch.float32),
        pad([t.response_versions for t in flat], -1, torch.long),
        pad([t.token_rewards() for t in flat], 0.0, torch.float32),
    ]


def one_step(batch_prompts, groups, tokenizer, runner) -> dict[str, float]:
    """Seconds of each phase of one step's driver work, and of the baseline."""
    times, clock = {}, time.perf_counter()

    def lap(name):
        nonlocal clock
        now = time.perf_counter()
        times[name], clock = now - clock, now

    trajectories = [[completion_trajectory(list(range(PROMPT_TOKENS)), c) for c in group] for group in groups]
    lap("trajectories")
    batch = batching.trajectory_batch(batch_prompts, trajectories, pad_token_id=0)
    lap("batch")
    plain_columns([t for group in trajectories for t in group])
    lap("baseline")
    batch["response_text"] = batching.decode_responses(batch, tokenizer)
    lap("decode")
    results = runner.score(list(batch["response_text"]), list(batch["ground_truth"]), list(batch["data_source"]))
    batch["scores"] = torch.tensor([r["score"] for r in results])
    batch["acc"] = batch["scores"].clone()
    batch["reward_info"] = [{} for _ in results]
    lap("rewards")
    batch_metrics(batch)
    lap("metrics")
    return times


def run_shape(samples: int, tokens: int, repeats: int, tokenizer) -> None:
    rng = random.Random(0)
    groups = completions(samples, tokens, len(tokenizer), rng)
    batch_prompts = prompts(len(groups), len(tokenizer))
    runner = RewardRunner(RewardConfig(num_workers=0))
    laps = [one_step(batch_prompts, groups, tokenizer, runner) for _ in range(repeats)]
    median = {k: statistics.median(lap[k] for lap in laps) * 1e3 for k in laps[0]}
    driver = sum(v for k, v in median.items() if k != "baseline")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in median.items() if k != "baseline")
    print(f"{samples} samples x {tokens} tokens: driver {driver:.2f} ms a step ({parts})")
    print(
        f"  batch {median['batch']:.2f} ms vs plain padded torch.tensor {median['baseline']:.2f} ms"
        f" = {median['batch'] / median['baseline']:.2f}x its time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--shapes", nargs="+", default=["256x4", "512x1024"], help="samples x response tokens")
    parser.add_argument("--repeats", type=int, default=0, help="steps per shape (0: 50 for short, 5 for long)")
    parser.add_argument("--tokenizer", default=str(REPO / "runs/quickstart/model"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if not Path(args.tokenizer).exists():
        sys.exit(
            f"no tokenizer at {args.tokenizer}: run `python scripts/prepare_quickstart.py` first, or pass --tokenizer"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)  # the prompts; the completions come from random.Random(0)
    for shape in args.shapes:
        samples, tokens = (int(x) for x in shape.lower().split("x"))
        run_shape(samples, tokens, args.repeats or (50 if samples * tokens < 100_000 else 5), tokenizer)


if __name__ == "__main__":
    main()
