"""Reward fns that misbehave on purpose, loaded by file path by tests/rewards/test_reward_runner.py."""

import os
import signal
import time


def raises_on_bad(solution_str, ground_truth, extra):
    if solution_str == "bad":
        raise ValueError("cannot parse 'bad'")
    return float(solution_str == ground_truth)


def sleeps_on_slow(solution_str, ground_truth, extra):
    if solution_str == "slow":
        time.sleep(60)
    return {"score": float(solution_str == ground_truth), "acc": 1.0}


def sleeps_its_seconds(solution_str, ground_truth, extra):
    if solution_str.startswith("sleep "):  # "sleep 0.25": that many seconds, then a right answer
        time.sleep(float(solution_str.split()[1]))
        return 1.0
    return float(solution_str == ground_truth)


def keeps_its_own_alarm(solution_str, ground_truth, extra):
    """Like math-verify's timeouts: its own SIGALRM handler and alarm around the work, `alarm(0)` after."""

    def on_alarm(signum, frame):
        raise TimeoutError("own alarm")

    if solution_str.startswith("sleep "):  # this one without: a plain slow sample
        return sleeps_its_seconds(solution_str, ground_truth, extra)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(5)
    try:
        return float(solution_str == ground_truth)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def hangs_ignoring_alarm(solution_str, ground_truth, extra):
    if solution_str == "hang":  # like C code that never checks for signals
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
    return float(solution_str == ground_truth)


def dies_on_crash(solution_str, ground_truth, extra):
    if solution_str == "crash":
        os._exit(7)
    return float(solution_str == ground_truth)


def returns_garbage(solution_str, ground_truth, extra):
    return "not a score"


def judge_batch(solution_strs, ground_truths, extras):
    """A batch-level reward (like a judge model): sees every sample at once, returns extra keys."""
    if "boom" in solution_strs:
        raise ConnectionError("judge service unreachable")
    size = len(solution_strs)
    return [
        {"score": float(s == g), "batch_size": size, "source_seen": extra["data_source"] == "math"}
        for s, g, extra in zip(solution_strs, ground_truths, extras)
    ]


def judge_batch_short(solution_strs, ground_truths, extras):
    return [1.0] * (len(solution_strs) - 1)
