"""The arithmetic reward with a gate, for tests that act at a known point of a run (loaded by path:
reward.reward_fn). While the file $MEGARL_TEST_GATE exists and $MEGARL_TEST_GATE_AFTER exists too
(e.g. a checkpoint's driver_state.pt), scoring touches `<gate>.waiting` and waits for the gate to be
removed; otherwise it is the plain `arithmetic` reward."""

import os
import time
from pathlib import Path

from megarl.rewards.tasks import arithmetic_reward


def reward(solution_str, ground_truth, extra):
    gate, after = os.environ.get("MEGARL_TEST_GATE"), os.environ.get("MEGARL_TEST_GATE_AFTER")
    if gate and after and Path(gate).exists() and Path(after).exists():
        Path(gate + ".waiting").touch()
        while Path(gate).exists():
            time.sleep(0.05)
    return arithmetic_reward(solution_str, ground_truth, extra)
