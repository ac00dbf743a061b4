#!/usr/bin/env python
"""Import time of what `megarl train`'s driver and fork server import from transformers, with and without
megarl's cache of transformers' import-time scans (`megarl.utils.import_cache`).

    python benchmarks/import_time.py              # 5 rounds, each a fresh interpreter per side, alternating
    python benchmarks/import_time.py --rounds 9

Each round runs `import megarl, transformers.models.auto.configuration_auto, transformers.utils.type_validators`
in a fresh interpreter with `MEGARL_IMPORT_CACHE=0` (the baseline: transformers reads its ~2,400 model files and
maps every installed distribution) and with the cache (filled once before the rounds, in a cache directory of
this run), and times the import inside the interpreter. Prints each side's median and range and the ratio of
the medians (cached / uncached; < 1 is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

PROBE = (
    "import time; t = time.perf_counter();"
    "import megarl, transformers.models.auto.configuration_auto, transformers.utils.type_validators;"
    "print(time.perf_counter() - t)"
)


def timed_import(cache_dir: str, cached: bool) -> float:
    env = {**os.environ, "MEGARL_CACHE_DIR": cache_dir, "MEGARL_IMPORT_CACHE": "1" if cached else "0"}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return float(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megarl_import_cache_") as cache_dir:
        cold = timed_import(cache_dir, cached=True)  # fills the cache
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.rounds):
            for cached in (False, True) if i % 2 == 0 else (True, False):
                times[cached].append(timed_import(cache_dir, cached))
    for cached, label in ((False, "uncached (baseline)"), (True, "cached")):
        t = times[cached]
        print(f"{label:20s} median {statistics.median(t):.2f} s  (range {min(t):.2f}-{max(t):.2f} s, {len(t)} runs)")
    print(f"cold cache (first run, fills it): {cold:.2f} s")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"ratio cached / uncached = {ratio:.2f}x the time")


if __name__ == "__main__":
    main()
