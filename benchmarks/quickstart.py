#!/usr/bin/env python
"""Benchmark: the quickstart end to end (`bash scripts/quickstart.sh`) over several seeds, timed.

    python benchmarks/quickstart.py                  # GRPO, seeds 0, 1, 2 (the README's figures)
    python benchmarks/quickstart.py --ppo            # the PPO quickstart, same criterion
    python benchmarks/quickstart.py --tool           # the tool quickstart (agent loop + calculator)
    python benchmarks/quickstart.py --seeds 1 --run-dir runs/bench_qs trainer.total_steps=50   # overrides pass through

Each seed is a whole quickstart: its own tiny model, data split, warm-up (`--rebuild`: built again even
where an earlier run left it) and trainer seed. Per seed it
prints the greedy validation accuracy before training (the baseline: the same run's step-0
validation) and after, the rise, the share of prompt groups without reward variance over the first
and last 10 steps, and the seconds of the training command alone (setup and warm-up excluded).
With --tool it also prints the share of greedy validation trajectories whose tool call succeeded
(`val/agent/tool_success`) before and after.
Then the median and range over the seeds, and the criterion of the quickstart: a median rise of at
least 0.25, every seed at least 0.15, training at most 180 s on 2 CPU cores (the tool quickstart: at
most 300 s, and every seed ends with a successful tool call in >= 90% of its greedy validation
trajectories). Step time is split into
generation, worker phases (log-probs, values, updates, weight sync) and the driver's overhead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.trainer.metrics import GENERATION_PHASES, WORKER_PHASES, read_metrics, validation_summary  # noqa: E402

CRITERION = {"median_rise": 0.25, "min_rise": 0.15, "max_train_s": 180.0, "min_tools_after": None}
TOOL_CRITERION = {**CRITERION, "max_train_s": 300.0, "min_tools_after": 0.9}
SCRIPTS = {
    "GRPO": ["scripts/quickstart.sh"],
    "PPO": ["scripts/quickstart.sh", "--ppo"],
    "tool": ["scripts/tool_quickstart.sh"],
}


def phase_shares(rows: list[dict]) -> dict:
    """Summed seconds of each phase group over the training steps, and its share of the summed step time."""
    steps = [r for r in rows if "time/step" in r]
    total = sum(r["time/step"] for r in steps)
    generation = sum(r.get(f"time/{p}", 0.0) for r in steps for p in GENERATION_PHASES)
    workers = sum(r.get(f"time/{p}", 0.0) for r in steps for p in WORKER_PHASES)
    driver = total - generation - workers
    return {
        "steps": len(steps),
        "step_s": total,
        "generation": generation / total,
        "workers": workers / total,
        "driver": driver / total,
    }


def zero_variance(rows: list[dict], window: int = 10) -> tuple[float, float]:
    """Mean share of prompt groups without reward variance over the first and the last `window` steps."""
    shares = [r["rollout/zero_variance_groups"] for r in rows if "rollout/zero_variance_groups" in r]
    if not shares:
        return float("nan"), float("nan")
    return statistics.mean(shares[:window]), statistics.mean(shares[-window:])


def tool_success(rows: list[dict]) -> tuple[float, float]:
    """`val/agent/tool_success` at the first and the last validation (nan without agent metrics)."""
    values = [r["val/agent/tool_success"] for r in rows if "val/agent/tool_success" in r]
    return (values[0], values[-1]) if values else (float("nan"), float("nan"))


def run_timed(command: list[str], what: str) -> tuple[subprocess.CompletedProcess, float]:
    """`command` run in the repository, output captured: (the finished process, its wall seconds); exits
    naming `what` with the output's tail when it fails."""
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, text=True, capture_output=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, wall


def run_seed(seed: int, run_dir: str, algo: str, overrides: list[str]) -> dict:
    """One whole quickstart; its validation before/after, training seconds and phase shares."""
    # --rebuild: the warm-up runs even when an earlier run left a current one (the whole script's time includes it)
    command = ["bash", *SCRIPTS[algo], "--seed", str(seed), "--rebuild", run_dir, *overrides]
    proc, wall = run_timed(command, f"quickstart (seed {seed})")
    rows = read_metrics(REPO / run_dir / "metrics.jsonl")
    summary = validation_summary(rows)
    if summary is None:
        sys.exit(f"seed {seed}: no validation in {run_dir}/metrics.jsonl (is validation.files set?)")
    (s0, _, acc0), (s1, _, acc1) = summary
    train_s = next(
        (float(line.split()[-2]) for line in proc.stdout.splitlines() if "quickstart] train took" in line),
        float("nan"),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("[prepare]"):
            print(f"  seed {seed} {line}", flush=True)  # the warm-up: steps, what the policy starts from
    zv_first, zv_last = zero_variance(rows)
    tools_before, tools_after = tool_success(rows)
    return {
        "seed": seed,
        "before": acc0,
        "after": acc1,
        "rise": acc1 - acc0,
        "first_step": s0,
        "last_step": s1,
        "train_s": train_s,
        "wall_s": wall,
        "zero_var_first": zv_first,
        "zero_var_last": zv_last,
        "tools_before": tools_before,
        "tools_after": tools_after,
        **phase_shares(rows),
    }


def summarize(results: list[dict], criterion: dict = CRITERION) -> dict:
    """Median and range of each figure over the seeds, and whether the quickstart's criterion holds."""

    def spread(key):
        values = [r[key] for r in results]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out = {key: spread(key) for key in ("before", "after", "rise", "train_s", "tools_before", "tools_after")}
    out["criterion_met"] = (
        out["rise"]["median"] >= criterion["median_rise"]
        and out["rise"]["min"] >= criterion["min_rise"]
        and out["train_s"]["max"] <= criterion["max_train_s"]
        and (criterion["min_tools_after"] is None or out["tools_after"]["min"] >= criterion["min_tools_after"])
    )
    return out


def fmt(spread: dict, spec: str = "{:.2f}") -> str:
    return f"{spec.format(spread['median'])} (range {spec.format(spread['min'])}..{spec.format(spread['max'])})"


def report(results: list[dict], summary: dict, algo: str) -> None:
    for r in results:
        print(
            f"seed {r['seed']}: greedy val acc {r['before']:.3f} (step {r['first_step']}) -> {r['after']:.3f}"
            f" (step {r['last_step']}), rise {r['rise']:+.3f}; groups without reward variance"
            f" {r['zero_var_first']:.2f} (first 10 steps) -> {r['zero_var_last']:.2f} (last 10);"
            f" training {r['train_s']:.0f} s (whole script {r['wall_s']:.0f} s); step time {r['step_s']:.0f} s:"
            f" generation {r['generation']:.0%}, workers {r['workers']:.0%}, driver {r['driver']:.0%}"
            + (f"; tool success {r['tools_before']:.2f} -> {r['tools_after']:.2f}" if algo == "tool" else "")
        )
    print(
        f"{algo} quickstart over {len(results)} seeds, median (range): greedy val acc {fmt(summary['before'])}"
        f" -> {fmt(summary['after'])}; rise {fmt(summary['rise'], '{:+.2f}')};"
        f" training command {fmt(summary['train_s'], '{:.0f}')} s; machine load (1 min) {os.getloadavg()[0]:.1f}"
        + (f"; tool success {fmt(summary['tools_before'])} -> {fmt(summary['tools_after'])}" if algo == "tool" else "")
    )
    crit = TOOL_CRITERION if algo == "tool" else CRITERION
    print(
        f"criterion (median rise >= {crit['median_rise']}, every seed >= {crit['min_rise']},"
        f" training <= {crit['max_train_s']:.0f} s"
        + (f", tool success after >= {crit['min_tools_after']}" if algo == "tool" else "")
        + f"): {'met' if summary['criterion_met'] else 'NOT met'}"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="run seeds 0 .. N-1")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ppo", action="store_true", help="the PPO quickstart (configs/ppo_quickstart.yaml)")
    which.add_argument("--tool", action="store_true", help="the tool quickstart (configs/tool_agent_quickstart.yaml)")
    parser.add_argument("--run-dir", default="runs/bench_quickstart", help="one sub-directory per seed")
    parser.add_argument("overrides", nargs="*", help="dotted overrides passed to megarl train")
    args = parser.parse_args(argv)
    algo = "PPO" if args.ppo else "tool" if args.tool else "GRPO"
    print(
        f"{algo} quickstart, {args.seeds} seed(s); machine load (1 min) at start {os.getloadavg()[0]:.1f}", flush=True
    )
    results = []
    for seed in range(args.seeds):
        results.append(run_seed(seed, f"{args.run_dir}/seed{seed}", algo, args.overrides))
        print(f"  seed {seed} done: {results[-1]['before']:.3f} -> {results[-1]['after']:.3f}", flush=True)
    summary = summarize(results, TOOL_CRITERION if algo == "tool" else CRITERION)
    report(results, summary, algo)
    return {"seeds": results, **summary}


if __name__ == "__main__":
    main(sys.argv[1:])
