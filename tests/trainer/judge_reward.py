"""A batch-level reward for the trainer tests (loaded by path: reward.batch_reward_fn), standing where a
judge model or a remote scoring service would: it gets the whole step at once, takes JUDGE_SECONDS
(like a network round trip), returns the arithmetic score plus extra keys (`format`, `judged`), and
appends the thread it ran on to $MEGARL_TEST_JUDGE_LOG."""

import os
import threading
import time

from megarl.rewards.tasks import arithmetic_reward

JUDGE_SECONDS = 2.0


def judge(solution_strs, ground_truths, extras):
    time.sleep(JUDGE_SECONDS)
    log = os.environ.get("MEGARL_TEST_JUDGE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{threading.current_thread().name} {len(solution_strs)}\n")
    return [
        {**arithmetic_reward(s, g, e), "format": float(s.strip().isdigit()), "judged": 1}
        for s, g, e in zip(solution_strs, ground_truths, extras)
    ]
