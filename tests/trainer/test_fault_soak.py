"""Fault soak, CI size: the short run is killed (SIGKILL of the driver's process group) at 3 random
points of `megarl.testing.fault_soak.KINDS` (start-up, a random moment, mid-checkpoint, mid-driver-state,
mid-pruning, mid-metrics rewrite, mid-export, damaged state after a kill), rerun after each, and every
non-timing metric of the reruns equals the uninterrupted run's; no process of the run outlives a kill.
`bash scripts/fault_soak.sh` runs the full 20 points. Reproduce a failure with MEGARL_SOAK_SEED=<seed>."""
import os
import random

from megarl.testing.fault_soak import Soak, table


def test_three_random_kills_resume_to_the_uninterrupted_metrics_and_leave_no_process(tiny_task, tmp_path):
    seed = int(os.environ.get("MEGARL_SOAK_SEED", random.randrange(2**31)))
    result = Soak(tmp_path, points=3, seed=seed, task=tiny_task).run()
    report = table(result)
    print(f"seed {seed}\n{report}")
    assert result.ok(), f"fault soak failed (MEGARL_SOAK_SEED={seed}):\n{report}\n{result.errors}"
    assert len(result.kills) == 3
