"""Fault injection: named points of the driver where the fault-soak harness can freeze a run to kill it.

Some moments of a run last milliseconds (renaming checkpoints for pruning, rewriting
metrics.jsonl, writing the driver state), so a kill at a random time would almost never land in
them. `hold(point)` is a no-op unless $MEGARL_FAULT_HOLD is `point` (or `point@n`: its n-th
occurrence in this process, 1-based); then it writes the point's name to $MEGARL_FAULT_HOLD_FILE
and sleeps until the harness kills the run (at most $MEGARL_FAULT_HOLD_S seconds, default 300).

Points: `checkpoint.driver_state` (engine checkpoints and manifest written, driver state not yet),
`prune` (old checkpoints renamed, not yet deleted), `metrics.rewrite` (truncated metrics.jsonl
written to its temp file, not yet renamed over the old one), and in the workers (the variables reach them
through Ray) `checkpoint.write` (an asynchronous checkpoint's writing thread, before it writes this rank's
files, while training goes on), `publish.<dir>` (`megarl.utils.atomic.publish_collective`: every rank wrote
its part of `<dir>` — `hf` for the final export, `actor`/`critic` for engine checkpoints — and the
directory is not published yet), `step.actor_update` (a step's samples generated and scored, its old
log-probs computed, the actor not yet updated) and `weights.broadcast` (rank 0 of the actor has broadcast
the first bucket of a weight update to the engine servers, the rest and the end of the update not yet).
Standard library only.
"""

from __future__ import annotations

import os
import time
from collections import Counter

POINTS = (
    "checkpoint.driver_state",
    "checkpoint.write",
    "prune",
    "metrics.rewrite",
    "publish.hf",
    "publish.actor",
    "publish.critic",
    "step.actor_update",
    "weights.broadcast",
)
_seen: Counter = Counter()


def hold(point: str) -> None:
    """Freeze here when $MEGARL_FAULT_HOLD names this point (see the module docstring)."""
    wanted = os.environ.get("MEGARL_FAULT_HOLD")
    if not wanted:
        return
    name, _, nth = wanted.partition("@")
    if name != point:
        return
    _seen[point] += 1
    if _seen[point] != int(nth or 1):
        return
    announce = os.environ.get("MEGARL_FAULT_HOLD_FILE")
    if announce:
        with open(announce, "w") as f:
            f.write(point)
    time.sleep(float(os.environ.get("MEGARL_FAULT_HOLD_S", "300")))
