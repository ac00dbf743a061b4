"""A batch-level reward for the trainer tests (loaded by path: reward.batch_reward_fn), standing where a
judge model or a remote scoring service would: it gets the whole step at once, takes JUDGE_SECONDS
(like a network round trip), returns the arithmetic score plus extra keys (`format`, `judged`, and
`overlapped`: 1 when the driver's main thread was seen computing log-probs meanwhile), and appends the
thread it ran on and the driver's frozen object count to $MEGARL_TEST_JUDGE_LOG."""

import gc
import linecache
import os
import sys
import threading
import time

from megarl.rewards.tasks import arithmetic_reward

JUDGE_SECONDS = 2.0


def judge(solution_strs, ground_truths, extras):
    overlapped = _wait_watching_the_main_thread(JUDGE_SECONDS)
    log = os.environ.get("MEGARL_TEST_JUDGE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{threading.current_thread().name} {len(solution_strs)} {gc.get_freeze_count()}\n")
    return [
        {**arithmetic_reward(s, g, e), "format": float(s.strip().isdigit()), "judged": 1, "overlapped": overlapped}
        for s, g, e in zip(solution_strs, ground_truths, extras)
    ]


def _wait_watching_the_main_thread(seconds: float) -> int:
    """Sleep `seconds` in steps of 1 ms; 1 if the main thread was at a `compute_log_probs` call meanwhile."""
    main, seen = threading.main_thread(), 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main.ident) if main is not threading.current_thread() else None
        while frame is not None and not seen:
            seen = int("compute_log_probs" in linecache.getline(frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        time.sleep(0.001)
    return seen
