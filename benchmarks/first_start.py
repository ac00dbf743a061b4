#!/usr/bin/env python
"""Benchmark: the quickstart's start-up on a machine's first run against a later run.

    python benchmarks/first_start.py               # 2 alternating rounds of each case
    python benchmarks/first_start.py --rounds 3

A newcomer's first `megarl train` differs from every later one by vLLM's model-info cache
(`$VLLM_CACHE_ROOT/modelinfos`, written on an engine's first start of an architecture; a fresh container
has none either). Each round runs `megarl train --config configs/grpo_quickstart.yaml trainer.total_steps=1`
(the quickstart's model, `scripts/prepare_quickstart.py` run first) three ways:

  * later run   — VLLM_CACHE_ROOT holding the entry an earlier run wrote (the baseline);
  * first run   — an empty VLLM_CACHE_ROOT, megarl's start (`vllm_start.model_info_in_process`);
  * first run, vLLM's own inspection — an empty VLLM_CACHE_ROOT and MEGARL_VLLM_MODEL_INFO=subprocess:
    vLLM inspects the model class in a new interpreter (the start before that change).

Prints the median "workers ready" seconds (and the engines' part of them) of each case and the ratios of
both first-run cases to the later run. Rounds alternate the cases (the machine's speed drifts).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/grpo_quickstart.yaml"
MODEL = "runs/quickstart/model"
DATA = "data/arithmetic"
READY = re.compile(r"workers ready in ([\d.]+) s .*engines ([\d.]+)\)")
CASES = ("later run", "first run", "first run, vLLM's own inspection")


def start_once(run_dir: str, cache_root: str, subprocess_inspection: bool) -> dict:
    """One `megarl train` of one step; its workers-ready line and wall time."""
    env = {**os.environ, "VLLM_CACHE_ROOT": cache_root}
    env.pop("MEGARL_VLLM_MODEL_INFO", None)
    if subprocess_inspection:
        env["MEGARL_VLLM_MODEL_INFO"] = "subprocess"
    command = [
        sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG, f"trainer.run_dir={run_dir}",
        "trainer.total_steps=1", "validation.before_train=false",
    ]  # fmt: skip
    subprocess.run(["rm", "-rf", run_dir], cwd=REPO, check=True)
    began = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"megarl train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ready = READY.search(proc.stdout)
    if ready is None:
        raise SystemExit(f"no 'workers ready' line in megarl train's output:\n{proc.stdout[-3000:]}")
    return {"ready_s": float(ready.group(1)), "engines_s": float(ready.group(2)), "wall_s": wall}


def run_case(case: str, run_dir: str, warm_root: str) -> dict:
    if case == "later run":
        return start_once(run_dir, warm_root, subprocess_inspection=False)
    with tempfile.TemporaryDirectory(prefix="vllm-cache-") as empty:
        result = start_once(run_dir, empty, subprocess_inspection=case != "first run")
        if not list(Path(empty, "modelinfos").glob("*.json")):
            raise SystemExit(f"{case}: vLLM wrote no model-info cache entry; the case measured nothing")
        return result


def report(results: dict[str, list[dict]]) -> dict[str, float]:
    median = {case: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for case, rows in results.items()}
    for case in CASES:
        m, each = median[case], ", ".join(f"{r['ready_s']:.1f}" for r in results[case])
        print(
            f"{case:34s} workers ready {m['ready_s']:5.1f} s (engines {m['engines_s']:4.1f} s),"
            f" command {m['wall_s']:5.1f} s   [{each}]"
        )
    base = median["later run"]["ready_s"]
    ratios = {case: median[case]["ready_s"] / base for case in CASES[1:]}
    for case, ratio in ratios.items():
        print(f"ratio {case} / later run (workers ready): {ratio:.2f}x")
    return ratios


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three cases")
    parser.add_argument("--run-dir", default="runs/bench_first_start")
    args = parser.parse_args(argv)
    prepare = ["scripts/prepare_quickstart.py", f"--model={MODEL}", f"--data={DATA}", "--seed=0"]
    subprocess.run([sys.executable, *prepare], cwd=REPO, check=True, capture_output=True, text=True)
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="vllm-cache-warm-") as warm_root:
        start_once(args.run_dir, warm_root, subprocess_inspection=False)  # writes the later runs' cache entry
        for i in range(args.rounds):
            for case in CASES:
                results[case].append(run_case(case, args.run_dir, warm_root))
                print(f"  round {i}: {case}: workers ready {results[case][-1]['ready_s']:.1f} s", flush=True)
    return report(results)


if __name__ == "__main__":
    main(sys.argv[1:])
