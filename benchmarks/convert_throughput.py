#!/usr/bin/env python
"""Conversion throughput: HF → megatron-core (and back) bytes/s vs a plain read+write of the same bytes.

    python benchmarks/convert_throughput.py                 # ~120M-param Llama, TP1 and TP2
    python benchmarks/convert_throughput.py --quick         # small model, seconds

The baseline reads every tensor of the HF safetensors file and writes them to a new safetensors
file, fsynced (the least work any durable conversion must do). The ratio `convert / baseline` (≤ 1; higher is
better) is printed for the weight-moving phase of the conversion (inside the ranks: HF read +
reshard + megatron save) and for the whole call (with the ranks' start-up; the first call of the process
starts the server they are forked from); mcore→hf reads each checkpoint back at TP1, in the calling
process (a dense model's export needs no ranks: `megarl/models/dcp_export.py`), from the disk (the
checkpoint was written behind). Last, the `megarl convert` commands against the baseline as a command of
its own: each a fresh process, imports and exit included (median of `--command-runs`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from megarl.models.convert import hf_to_mcore, mcore_to_hf
from megarl.models.layout import ParallelLayout
from megarl.testing.models import save_tiny_hf_model


def baseline_seconds(hf_dir: Path, out: Path) -> float:
    """Read every tensor, write them to one new safetensors file, fsync it (a checkpoint must be durable)."""
    start = time.perf_counter()
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    target = out / "copy.safetensors"
    save_file(tensors, str(target))
    with open(target, "rb+") as handle:
        os.fsync(handle.fileno())
    return time.perf_counter() - start


BASELINE_COMMAND = """
import os, sys
from safetensors.torch import load_file, save_file
tensors = {}
for f in sys.argv[1:-1]:
    tensors.update(load_file(f))
save_file(tensors, sys.argv[-1])
with open(sys.argv[-1], "rb+") as handle:
    os.fsync(handle.fileno())
"""


def command_seconds(argv: list[str], runs: int, fresh: Path) -> float:
    """Median wall time of `argv` as a fresh process (`fresh`, its output, removed before each run)."""
    times = []
    for _ in range(runs):
        if fresh.is_dir():
            shutil.rmtree(fresh)
        elif fresh.exists():
            fresh.unlink()
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare_commands(hf_dir: Path, root: Path, runs: int) -> None:
    """`megarl convert hf-to-mcore` and `mcore-to-hf` (TP1) against the baseline run as a command."""
    files = [str(f) for f in sorted(hf_dir.glob("*.safetensors"))]
    base = command_seconds(
        [sys.executable, "-c", BASELINE_COMMAND, *files, str(root / "cmd_copy.st")], runs, root / "cmd_copy.st"
    )
    cli = [sys.executable, "-m", "megarl.cli", "convert"]
    mcore, back = root / "cmd_mcore", root / "cmd_back"
    to_mcore = command_seconds([*cli, "hf-to-mcore", "--hf-path", str(hf_dir), "--mcore-path", str(mcore)], runs, mcore)
    to_hf = command_seconds([*cli, "mcore-to-hf", "--mcore-path", str(mcore), "--hf-path", str(back)], runs, back)
    print(
        f"commands (fresh processes, median of {runs}): plain read+write {base:.1f}s;"
        f" megarl convert hf-to-mcore {to_mcore:.1f}s (ratio {base / to_mcore:.2f});"
        f" mcore-to-hf {to_hf:.1f}s (ratio {base / to_hf:.2f})"
    )


def model_bytes(hf_dir: Path) -> int:
    return sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layouts", default="1x1,2x1", help="comma-separated TPxPP layouts")
    parser.add_argument("--command-runs", type=int, default=3, help="runs of each command (0: none)")
    args = parser.parse_args()
    size = (
        dict(hidden_size=128, num_layers=2, intermediate_size=256, vocab_size=1000)
        if args.quick
        else dict(hidden_size=768, num_layers=12, intermediate_size=2048, vocab_size=32000)
    )
    root = Path(tempfile.mkdtemp(prefix="megarl_bench_"))
    try:
        hf_dir = root / "hf"
        save_tiny_hf_model(
            "llama", hf_dir, num_heads=12 if not args.quick else 4, num_kv_heads=4 if not args.quick else 2, **size
        )
        nbytes = model_bytes(hf_dir)
        base = min(baseline_seconds(hf_dir, root) for _ in range(2))
        print(
            f"model: {nbytes / 2**20:.1f} MiB fp32 safetensors; baseline read+write {nbytes / base / 2**20:.1f} MiB/s"
        )
        for spec in args.layouts.split(","):
            tp, pp = (int(x) for x in spec.split("x"))
            layout = ParallelLayout(tp=tp, pp=pp)
            start = time.perf_counter()
            meta = hf_to_mcore(hf_dir, root / f"mcore_{spec}", layout)
            wall = time.perf_counter() - start
            inner = meta["seconds"]["load"] + meta["seconds"]["save"]
            start = time.perf_counter()
            mcore_to_hf(root / f"mcore_{spec}", root / f"back_{spec}")
            back = time.perf_counter() - start
            load, save = meta["seconds"]["load"], meta["seconds"]["save"]
            print(
                f"tp={tp} pp={pp}: hf→mcore weights phase {nbytes / inner / 2**20:.1f} MiB/s, ratio vs baseline"
                f" {base / inner:.2f} (HF read+reshard {load:.2f}s, megatron torch_dist save {save:.2f}s);"
                f" whole call {wall:.1f}s (ratio {base / wall:.2f}); mcore→hf whole call {back:.1f}s"
                f" (ratio {base / back:.2f})"
            )
        if args.command_runs:
            compare_commands(hf_dir, root, args.command_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
