"""A CPU run's worker processes keep to their share of the node's CPUs (`workers.base.keep_to_cpu_share`),
and so do the threads and processes they start (the vLLM engine core a rank forks)."""

import json
import os
import subprocess
import sys

import pytest

from megarl.workers.base import cpu_share


@pytest.mark.parametrize(
    "cpus, size, expected",
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2], 2, [[0], [1, 2]]),
        ([0, 1], 4, [[0], [0], [1], [1]]),  # fewer CPUs than ranks: shared evenly
        ([4, 6], 1, [[4, 6]]),
    ],
)
def test_each_local_rank_gets_a_contiguous_share_and_every_cpu_is_used(cpus, size, expected):
    assert [cpu_share(cpus, rank, size) for rank in range(size)] == expected


CHILD = """
import json, os, subprocess, sys, threading
from megarl.workers.base import cpu_share, keep_to_cpu_share

before = threading.Event()
waiting = threading.Thread(target=before.wait)  # a thread that exists before the binding (Ray's own)
waiting.start()
allowed = sorted(os.sched_getaffinity(0))
keep_to_cpu_share(1, 2)
threads = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
later = {}
started = threading.Thread(target=lambda: later.update(cpus=sorted(os.sched_getaffinity(0))))
started.start(); started.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout.strip()
before.set(); waiting.join()
print(json.dumps({"allowed": allowed, "share": cpu_share(allowed, 1, 2), "threads": list(threads.values()),
                  "later": later["cpus"], "child": json.loads(child)}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one CPU")
def test_a_bound_worker_its_threads_and_the_processes_it_starts_keep_to_its_share():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["share"] != seen["allowed"] and seen["share"] == cpu_share(seen["allowed"], 1, 2)
    assert len(seen["threads"]) >= 2 and all(cpus == seen["share"] for cpus in seen["threads"])
    assert seen["later"] == seen["share"] and seen["child"] == seen["share"]
