#!/usr/bin/env python
"""Import time of what `megarl train`'s driver and fork server import, with and without megarl's import-time
savings: the cache of transformers' import-time scans (`megarl.utils.import_cache`) and vLLM's import without
inductor's lowering (`megarl.utils.lazy_lowering`).

    python benchmarks/import_time.py              # 5 rounds, each a fresh interpreter per side, alternating
    python benchmarks/import_time.py --rounds 9

Each round runs, in a fresh interpreter per side and timed inside it:
  * transformers: `import megarl, transformers.models.auto.configuration_auto, transformers.utils.type_validators`
    with `MEGARL_IMPORT_CACHE=0` (the baseline: transformers reads its ~2,400 model files and maps every
    installed distribution) and with the cache (filled once before the rounds, in a cache directory of this run);
  * vllm (where it imports): `import vllm` after torch and megarl, with `MEGARL_LAZY_LOWERING=0` (the baseline:
    `vllm.env_override` imports `torch._inductor.lowering`) and without (the lowering waits for its first use).
Prints each side's median and range and the ratio of the medians (after / before; < 1 is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

CASES = {  # name: (what is timed, what runs before it untimed, the opt-out variable of the baseline)
    "transformers": (
        "import megarl, transformers.models.auto.configuration_auto, transformers.utils.type_validators",
        "",
        "MEGARL_IMPORT_CACHE",
    ),
    "vllm": ("import vllm", "import torch, megarl", "MEGARL_LAZY_LOWERING"),
}


def timed_import(case: str, cache_dir: str, saving: bool) -> float:
    timed, before, opt_out = CASES[case]
    probe = f"{before}\nimport time; t = time.perf_counter()\n{timed}\nprint(time.perf_counter() - t)"
    env = {**os.environ, "MEGARL_CACHE_DIR": cache_dir, opt_out: "1" if saving else "0"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{case} import failed:\n{run.stderr[-2000:]}")
    return float(run.stdout.strip().splitlines()[-1])


def report(case: str, times: dict[bool, list[float]]) -> None:
    for saving, label in ((False, "before (baseline)"), (True, "after")):
        t = times[saving]
        print(f"  {label:18s} median {statistics.median(t):.2f} s  (range {min(t):.2f}-{max(t):.2f} s, {len(t)} runs)")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"  ratio after / before = {ratio:.2f}x the time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = [case for case in CASES if case != "vllm" or importlib.util.find_spec("vllm") is not None]
    with tempfile.TemporaryDirectory(prefix="megarl_import_cache_") as cache_dir:
        cold = timed_import("transformers", cache_dir, saving=True)  # fills the cache
        times = {case: {False: [], True: []} for case in cases}
        for i in range(args.rounds):
            for case in cases:
                for saving in (False, True) if i % 2 == 0 else (True, False):
                    times[case][saving].append(timed_import(case, cache_dir, saving))
    for case in cases:
        print(f"{case}:")
        report(case, times[case])
    print(f"transformers with a cold cache (the first run, which fills it): {cold:.2f} s")


if __name__ == "__main__":
    main()
