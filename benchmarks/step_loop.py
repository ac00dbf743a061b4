#!/usr/bin/env python
"""Benchmark: the quickstart's GRPO step loop against a plain single-process reference of the same step.

    python benchmarks/step_loop.py                   # 100 steps (the quickstart), seed 0, one round
    python benchmarks/step_loop.py --steps 50 --rounds 2 --seed 1
    python benchmarks/step_loop.py --rounds 2 rollout.engine=embedded   # overrides for megarl's side

Both sides train the quickstart's model (`scripts/prepare_quickstart.py --seed SEED`, run first: the
tiny Qwen2 after its SFT warm-up; reused when the last one of that seed is current) on the same data with the same
GRPO step (configs/grpo_quickstart.yaml: 32 prompts × 8 samples, temperature 1, at most 4 response
tokens, exact-answer reward, GRPO advantages, PPO-clip token-mean loss, AdamW lr 1e-3 with 2 warm-up
steps and cosine decay to 1e-4, grad clip 1.0):

  * reference — one Python process, no Ray, no megatron, no vLLM: `transformers` `generate` (sampling
    from the full distribution, left-padded prompts), megarl's reward function, GRPO estimator and
    PPO-clip loss on one forward over the whole batch (one on-policy update per step: the old
    log-probs are the same forward's, detached), `torch.optim.AdamW`. Its greedy accuracy on the
    200 held-out problems is printed before and after (outside the timing) to show it learns;
  * megarl — `megarl train --config configs/grpo_quickstart.yaml` as the quickstart runs it (Ray, two
    gloo ranks with a DP2 megatron actor, a vLLM CPU engine each where installed, weight sync).
    Its step loop is the sum of `time/step` in metrics.jsonl (what `train_step` takes); the
    command's wall time is split into workers ready, the step loop and everything else
    (driver start-up, validation, checkpoint, plot, shutdown).

Rounds alternate reference and megarl (the machine's speed drifts between minutes); the ratio is
taken from each side's fastest round. Prints both loops' seconds and per-step medians, the ratio
megarl / reference (issue 17's goal: ≤ 1.25) and the share of the command outside the step loop
(goal: ≤ 15%). `--threads` sets the reference's torch threads (default 1: with matrices this small a
second thread only adds synchronisation; megarl's ranks run one thread each as well).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = "configs/grpo_quickstart.yaml"
MODEL = "runs/quickstart/model"
DATA = "data/arithmetic"
GOAL_RATIO, GOAL_OUTSIDE = 1.25, 0.15


# -- the reference ---------------------------------------------------------------------------------
def quickstart_settings() -> dict:
    """The knobs of the quickstart config the reference needs (read from the same YAML, not copied)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / CONFIG)
    return {
        "prompts": cfg.trainer.prompts_per_step,
        "samples": cfg.rollout.samples_per_prompt,
        "max_new": cfg.rollout.max_response_tokens,
        "temperature": cfg.rollout.temperature,
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "optim": OmegaConf.to_container(cfg.actor.optim),
    }


def lr_lambda(optim: dict):
    """megatron's OptimizerParamScheduler as the engine configures it: linear warm-up from 0, then
    cosine (or constant) decay to min_lr over decay_steps; as a factor of the peak lr."""
    peak, floor = optim["lr"], optim.get("min_lr", 0.0)
    warmup = optim.get("warmup_steps", 0)
    decay = max(optim.get("decay_steps") or 0, warmup + 1)

    def factor(step: int) -> float:
        if warmup and step <= warmup:
            return step / warmup
        if optim.get("decay_style", "constant") == "constant":
            return 1.0
        ratio = min((step - warmup) / (decay - warmup), 1.0)
        return (floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)) / peak

    return factor


def response_mask(responses, eos: int):
    """1 on every generated token up to and including the first eos (0 after it)."""

    is_eos = (responses == eos).int()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).float()


def rewards_of(tok, responses, mask, rows) -> list[float]:
    from megarl.rewards.tasks import arithmetic_reward

    texts = tok.batch_decode((responses * mask.long()).tolist(), skip_special_tokens=True)
    return [arithmetic_reward(t, r["ground_truth"], r.get("extra_info") or {})["score"] for t, r in zip(texts, rows)]


def reference_step(model, optimizer, scheduler, tok, batch, rows, s: dict) -> dict:
    """One GRPO step in one process: sample, score, advantages, one update. Returns phase seconds."""
    import torch

    from megarl.algorithms.advantages import AdvantageConfig, AdvantageInputs, grpo
    from megarl.algorithms.aggregation import LossAggregation
    from megarl.algorithms.policy_loss import PolicyLossConfig, PolicyLossInputs, ppo_clip
    from megarl.trainer.batching import outcome_rewards

    times, t0 = {}, time.perf_counter()
    ids = batch["input_ids"].repeat_interleave(s["samples"], 0)
    attention = batch["attention_mask"].repeat_interleave(s["samples"], 0)
    rows = [r for r in rows for _ in range(s["samples"])]
    model.eval()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=attention, do_sample=True, temperature=s["temperature"], top_k=0, top_p=1.0,
            max_new_tokens=s["max_new"], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    width = ids.shape[1]
    responses = out[:, width:]
    mask = response_mask(responses, tok.eos_token_id)
    times["generate"], t0 = time.perf_counter() - t0, time.perf_counter()

    scores = torch.tensor(rewards_of(tok, responses, mask, rows))
    token_rewards = outcome_rewards(scores, mask)
    groups = torch.arange(len(batch["input_ids"])).repeat_interleave(s["samples"])
    advantages, _ = grpo(AdvantageInputs(token_rewards, mask, group_ids=groups), AdvantageConfig())
    times["reward"], t0 = time.perf_counter() - t0, time.perf_counter()

    model.train()
    full_attention = torch.cat([attention, torch.ones_like(responses)], 1)
    positions = (full_attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(out, attention_mask=full_attention, position_ids=positions).logits[:, width - 1 : -1]
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None]).squeeze(-1)
    inputs = PolicyLossInputs(log_probs, log_probs.detach(), advantages, mask)
    loss, _ = ppo_clip(inputs, PolicyLossConfig(), LossAggregation.for_batch("token-mean", mask))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), s["optim"].get("clip_grad", 1.0))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    times["update"] = time.perf_counter() - t0
    times["reward_mean"] = float(scores.mean())
    return times


def greedy_accuracy(model, tok, test_rows) -> float:
    from megarl.trainer.sft import greedy_answers, sft_examples

    answers = greedy_answers(model, sft_examples(test_rows, tok))
    texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
    return sum(t.strip() == str(r["ground_truth"]) for t, r in zip(texts, test_rows)) / len(test_rows)


def run_reference(steps: int, seed: int, threads: int) -> dict:
    """The reference loop over `steps` steps; seconds of the loop (validation excluded) and per phase."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.datasets import DataConfig, PromptDataset, PromptLoader, load_rows
    from megarl.data.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    s = quickstart_settings()
    tok = load_tokenizer(str(REPO / MODEL))
    data = DataConfig(
        files=[str(REPO / DATA / "train.parquet")], max_prompt_tokens=s["max_prompt_tokens"],
        apply_chat_template=False, seed=seed,
    )  # fmt: skip
    loader = PromptLoader.from_config(PromptDataset(data, tok), data, s["prompts"])
    model = AutoModelForCausalLM.from_pretrained(str(REPO / MODEL), dtype=torch.float32)
    o = s["optim"]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o["lr"], betas=(o.get("adam_beta1", 0.9), o.get("adam_beta2", 0.999)),
        eps=o.get("adam_eps", 1e-8), weight_decay=o.get("weight_decay", 0.0),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o))
    test_rows = load_rows(str(REPO / DATA / "test.parquet"))[0]
    before = greedy_accuracy(model, tok, test_rows)
    phases: list[dict] = []
    start = time.perf_counter()
    for _ in range(steps):
        batch = loader.next_batch()
        rows = [{"ground_truth": g} for g in batch["ground_truth"]]
        step_start = time.perf_counter()
        phases.append(reference_step(model, optimizer, scheduler, tok, batch, rows, s))
        phases[-1]["step"] = time.perf_counter() - step_start
    loop = time.perf_counter() - start
    after = greedy_accuracy(model, tok, test_rows)
    return {"loop_s": loop, "steps": phases, "before": before, "after": after}


# -- megarl ------------------------------------------------------------------------------------------
def run_megarl(steps: int, seed: int, run_dir: str, overrides: tuple[str, ...] = ()) -> dict:
    """`megarl train` on the quickstart config (plus `overrides`); wall time, step loop and the parts it prints."""
    from quickstart import run_timed

    from megarl.trainer.metrics import read_metrics, validation_summary

    command = [
        sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG, f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"data.seed={seed}", *overrides,
    ]  # fmt: skip
    subprocess.run(["rm", "-rf", run_dir], cwd=REPO, check=True)
    proc, wall = run_timed(command, "megarl train")
    rows = read_metrics(REPO / run_dir / "metrics.jsonl")
    steps_rows = [r for r in rows if "time/step" in r]
    ready = re.search(r"workers ready in ([\d.]+) s", proc.stdout)
    summary = validation_summary(rows)
    return {
        "wall_s": wall,
        "loop_s": sum(r["time/step"] for r in steps_rows),
        "steps": steps_rows,
        "ready_s": float(ready.group(1)) if ready else float("nan"),
        "before": summary[0][2] if summary else float("nan"),
        "after": summary[1][2] if summary else float("nan"),
        "parts": next((line for line in proc.stdout.splitlines() if "time in the loop" in line), ""),
    }


# -- report ------------------------------------------------------------------------------------------
def median_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def report(refs: list[dict], megs: list[dict], steps: int) -> dict:
    ref, meg = min(refs, key=lambda r: r["loop_s"]), min(megs, key=lambda r: r["loop_s"])
    for i, (r, m) in enumerate(zip(refs, megs)):
        print(
            f"round {i}: reference loop {r['loop_s']:.1f} s (greedy val acc {r['before']:.3f} -> {r['after']:.3f});"
            f" megarl loop {m['loop_s']:.1f} s, command {m['wall_s']:.1f} s, workers ready {m['ready_s']:.1f} s"
            f" (val acc {m['before']:.3f} -> {m['after']:.3f})"
        )
    print(
        f"reference per step (median): {median_of(ref['steps'], 'step') * 1e3:.0f} ms ="
        f" generate {median_of(ref['steps'], 'generate') * 1e3:.0f} + reward/advantages"
        f" {median_of(ref['steps'], 'reward') * 1e3:.0f} + update {median_of(ref['steps'], 'update') * 1e3:.0f}"
    )
    phases = sorted(
        {k for r in meg["steps"] for k in r if k.startswith("time/") and k != "time/step" and not k.endswith("_share")}
    )
    print(
        f"megarl per step (median): {median_of(meg['steps'], 'time/step') * 1e3:.0f} ms; "
        + ", ".join(f"{k[5:]} {median_of(meg['steps'], k) * 1e3:.0f}" for k in phases)
    )
    if meg["parts"]:
        print(f"megarl {meg['parts'].removeprefix('[megarl] ')}")
    ratio = meg["loop_s"] / ref["loop_s"]
    outside = 1.0 - meg["loop_s"] / meg["wall_s"]
    print(
        f"{steps} steps: megarl step loop {meg['loop_s']:.1f} s / reference {ref['loop_s']:.1f} s ="
        f" {ratio:.2f}x (goal <= {GOAL_RATIO}: {'met' if ratio <= GOAL_RATIO else 'NOT met'}); megarl outside the"
        f" step loop {meg['wall_s'] - meg['loop_s']:.1f} s of the {meg['wall_s']:.1f} s command = {outside:.0%}"
        f" (goal <= {GOAL_OUTSIDE:.0%}: {'met' if outside <= GOAL_OUTSIDE else 'NOT met'});"
        f" machine load (1 min) {os.getloadavg()[0]:.1f}"
    )
    return {"ratio": ratio, "outside": outside, "reference_s": ref["loop_s"], "megarl_s": meg["loop_s"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each side (quickstart: 100)")
    parser.add_argument("--seed", type=int, default=0, help="model, data and trainer seed")
    parser.add_argument("--rounds", type=int, default=1, help="alternating reference/megarl rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the reference")
    parser.add_argument("--run-dir", default="runs/bench_step_loop")
    parser.add_argument(
        "overrides", nargs="*", help="dotted config overrides for megarl's side, e.g. rollout.engine=embedded"
    )
    args = parser.parse_args(argv)
    prepare = ["scripts/prepare_quickstart.py", f"--model={MODEL}", f"--data={DATA}", f"--seed={args.seed}"]
    done = subprocess.run([sys.executable, *prepare], cwd=REPO, check=True, capture_output=True, text=True)
    print(*(line for line in done.stdout.splitlines() if line.startswith("[prepare]")), sep="\n", flush=True)
    extra = f"; megarl with {' '.join(args.overrides)}" if args.overrides else ""
    print(
        f"{args.steps} steps, seed {args.seed}{extra}; machine load (1 min) at start {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    refs, megs = [], []
    for i in range(args.rounds):
        refs.append(run_reference(args.steps, args.seed, args.threads))
        print(f"  round {i}: reference {refs[-1]['loop_s']:.1f} s", flush=True)
        megs.append(run_megarl(args.steps, args.seed, args.run_dir, tuple(args.overrides)))
        print(f"  round {i}: megarl loop {megs[-1]['loop_s']:.1f} s, command {megs[-1]['wall_s']:.1f} s", flush=True)
    return report(refs, megs, args.steps)


if __name__ == "__main__":
    main(sys.argv[1:])
