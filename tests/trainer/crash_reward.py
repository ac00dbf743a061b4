"""The arithmetic reward, plus a crash switch for the resume test (loaded by path: reward.reward_fn).

When the file named by $MEGARL_TEST_CRASH_ARMED exists and the run has a complete checkpoint at
step 2, the first sample scored afterwards writes `<armed>.blocked` and sleeps, so the test can
kill the whole run at a known point (inside step 3, after the checkpoint). Otherwise it is the
plain `arithmetic` reward.
"""

import os
import time
from pathlib import Path

from megarl.rewards.tasks import arithmetic_reward


def reward(solution_str, ground_truth, extra):
    armed = os.environ.get("MEGARL_TEST_CRASH_ARMED")
    if (
        armed
        and Path(armed).exists()
        and (Path(armed).parent / "run_b/checkpoints/step_000002/driver_state.pt").exists()
    ):
        Path(armed + ".blocked").touch()
        time.sleep(8)
    return arithmetic_reward(solution_str, ground_truth, extra)
