#!/usr/bin/env python
"""Benchmark: the quickstart end to end (`bash scripts/quickstart.sh`), timed.

    python benchmarks/quickstart.py                              # the full quickstart
    python benchmarks/quickstart.py --run-dir runs/bench_qs trainer.total_steps=50   # overrides pass through

Prints the wall time (whole script, and the training command alone), the validation score
before and after training and their ratio (the baseline is the same run's step-0 validation),
and where step time goes: generation, worker phases (log-probs, values, updates, weight sync),
and the rest, the driver's overhead (batch assembly, rule rewards, advantages, Ray transfers,
logging), as a share of the summed step time.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.trainer.metrics import GENERATION_PHASES, WORKER_PHASES, read_metrics, validation_summary  # noqa: E402


def phase_shares(rows: list[dict]) -> dict:
    """Summed seconds of each phase group over the training steps, and its share of the summed step time."""
    steps = [r for r in rows if "time/step" in r]
    total = sum(r["time/step"] for r in steps)
    generation = sum(r.get(f"time/{p}", 0.0) for r in steps for p in GENERATION_PHASES)
    workers = sum(r.get(f"time/{p}", 0.0) for r in steps for p in WORKER_PHASES)
    driver = total - generation - workers
    return {"steps": len(steps), "step_s": total, "generation": generation / total, "workers": workers / total,
            "driver": driver / total}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/bench_quickstart")
    parser.add_argument("overrides", nargs="*", help="dotted overrides passed to megarl train")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/quickstart.sh", args.run_dir, *args.overrides], cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, "MEGARL_TIME_TRAIN": "1"})
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"quickstart failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = read_metrics(REPO / args.run_dir / "metrics.jsonl")
    (s0, before, acc0), (s1, after, acc1) = validation_summary(rows)
    shares = phase_shares(rows)
    train_s = next((float(line.split()[-2]) for line in proc.stdout.splitlines() if line.startswith("[quickstart] train")),
                   float("nan"))
    load = os.getloadavg()[0]
    print(f"quickstart wall time: {wall:.0f} s (training command {train_s:.0f} s), machine load {load:.1f}")
    print(f"validation score: {before:.3f} (acc {acc0:.2f}, step {s0}) -> {after:.3f} (acc {acc1:.2f}, step {s1});"
          f" after/before = {after / before if before else float('inf'):.2f}x")
    print(f"step time over {shares['steps']} steps: {shares['step_s']:.1f} s; generation {shares['generation']:.1%},"
          f" workers (log-probs, updates, sync) {shares['workers']:.1%}, driver overhead {shares['driver']:.1%}")
    return {"wall_s": wall, "train_s": train_s, "val_before": before, "val_after": after, **shares}


if __name__ == "__main__":
    main(sys.argv[1:])
