"""Fault soak, CI size: the short run is killed (SIGKILL of the driver's process group) at 3 random
points of `megarl.trainer.fault_points.KINDS` (start-up, a random moment, mid-checkpoint, mid-driver-state,
mid-pruning, mid-metrics rewrite, mid-export, damaged state after a kill), rerun after each, and every
non-timing metric of the reruns equals the uninterrupted run's; no process of the run outlives a kill.
`bash scripts/fault_soak.sh` runs the full 20 points. Reproduce a failure with MEGARL_SOAK_SEED=<seed>.

Then the second line of defence, with real engine checkpoints: the uninterrupted run's latest
checkpoint gets a shard whose head is zeroed (same size) and loses its manifest, so no check before
Ray can tell; the workers' load fails, the run falls back to the previous checkpoint and ends with
the uninterrupted run's metrics."""

import os
import random
import shutil

import pytest

from megarl.trainer import state
from megarl.trainer.fault_points import Launch
from megarl.trainer.fault_soak import Soak, max_delta, table
from megarl.trainer.metrics import read_metrics


@pytest.fixture(scope="module")
def soak(tiny_task, tmp_path_factory):
    seed = int(os.environ.get("MEGARL_SOAK_SEED", random.randrange(2**31)))
    root = tmp_path_factory.mktemp("soak")
    return seed, root, Soak(root, points=3, seed=seed, task=tiny_task).run()


def test_three_random_kills_resume_to_the_uninterrupted_metrics_and_leave_no_process(soak):
    seed, _, result = soak
    report = table(result)
    print(f"seed {seed}\n{report}")
    assert result.ok(), f"fault soak failed (MEGARL_SOAK_SEED={seed}):\n{report}\n{result.errors}"
    assert len(result.kills) == 3


def test_a_checkpoint_the_workers_cannot_load_falls_back_to_the_previous_one(soak, tiny_task):
    _, root, _ = soak
    whole, damaged = root / "uninterrupted", root / "unloadable"
    shutil.copytree(whole, damaged)
    shutil.rmtree(damaged / "hf")  # without the final export: the rerun has work to do
    latest = state.step_dir(damaged, 4)
    shard = sorted(latest.glob("actor/*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.write(bytes(64))
    (latest / state.MANIFEST).unlink()
    assert state.checkpoint_problem(latest) is None  # nothing before Ray can tell
    run = Launch(tiny_task, damaged, root / "unloadable.log")
    code, left = run.finish()
    out = run.text()
    assert code == 0 and not left, out[-3000:]
    assert f"loading checkpoint {latest} failed" in out and "UnpicklingError" in out, out[-3000:]
    assert "resumed from" in out and "(step 3)" in out
    rows, reference = read_metrics(damaged / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in reference] and max_delta(rows, reference) == 0.0
