import asyncio
import os
import time

import pytest

from megarl.rewards import RewardConfig, RewardRunner

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reward_helpers.py")


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(RewardConfig(num_workers=2, timeout_s=0.5, kill_grace_s=0.5)) as r:
        yield r


def _use(runner, fn_name):
    runner.config.reward_fn = f"{HELPERS}:{fn_name}"


def test_score_by_data_source_uses_builtin_rewards(runner):
    runner.config.reward_fn = None
    out = runner.score(
        ["#### 42", "\\boxed{\\frac12}", "7"], ["42", "0.5", "7"], ["openai/gsm8k", "math", "arithmetic"]
    )
    assert [r["score"] for r in out] == [1.0, 1.0, 1.0]
    assert all(r["reward_error"] is None for r in out)


def test_reward_fn_that_raises_records_failure_and_scores_others(runner):
    _use(runner, "raises_on_bad")
    out = runner.score(["a", "bad", "b"], ["a", "a", "b"])
    assert [r["score"] for r in out] == [1.0, 0.0, 1.0]
    assert "ValueError: cannot parse 'bad'" in out[1]["reward_error"]
    assert out[0]["reward_error"] is None and out[2]["reward_error"] is None


def test_reward_fn_sleeping_past_timeout_records_timeout_and_scores_others(runner):
    _use(runner, "sleeps_on_slow")
    start = time.monotonic()
    out = runner.score(["x", "slow", "y", "z"], ["x", "slow", "y", "q"])
    assert time.monotonic() - start < 5
    assert [r["score"] for r in out] == [1.0, 0.0, 1.0, 0.0]
    assert out[1]["reward_error"].startswith("timeout")
    assert out[3]["reward_error"] is None and out[3]["acc"] == 1.0


def test_worker_ignoring_alarm_is_killed_pool_recreated_and_others_scored(runner):
    _use(runner, "hangs_ignoring_alarm")
    out = runner.score(["a", "hang", "b", "c", "d"], ["a", "hang", "b", "c", "x"])
    assert [r["score"] for r in out] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert "killed" in out[1]["reward_error"]
    _use(runner, "raises_on_bad")  # the recreated pool keeps working
    assert runner.score(["a"], ["a"])[0]["score"] == 1.0


def test_worker_process_dying_records_failure_and_scores_others(runner):
    _use(runner, "dies_on_crash")
    solutions = ["a", "crash", "a", "a", "a", "crash", "a", "a"]
    out = runner.score(solutions, ["a"] * 8)
    assert [r["score"] for r in out] == [0.0 if s == "crash" else 1.0 for s in solutions]
    assert "died" in out[1]["reward_error"] and "died" in out[5]["reward_error"]
    assert all(r["reward_error"] is None for s, r in zip(solutions, out) if s != "crash")


def test_non_numeric_result_records_failure(runner):
    _use(runner, "returns_garbage")
    out = runner.score(["a"], ["a"])
    assert out[0]["score"] == 0.0 and "TypeError" in out[0]["reward_error"]


def test_score_async_overlaps_with_other_coroutines(runner):
    _use(runner, "sleeps_on_slow")

    async def main():
        ticks = []

        async def ticker():
            for _ in range(3):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        results, _ = await asyncio.gather(runner.score_async(["slow", "a"], ["x", "a"]), ticker())
        return results, ticks

    results, ticks = asyncio.run(main())
    assert [r["score"] for r in results] == [0.0, 1.0]
    assert len(ticks) == 3


def test_failure_score_is_configurable_in_process():
    r = RewardRunner(RewardConfig(num_workers=0, failure_score=-1.0, reward_fn=f"{HELPERS}:raises_on_bad"))
    assert [x["score"] for x in r.score(["bad", "a"], ["a", "a"])] == [-1.0, 1.0]


def test_in_process_timeout_records_it_scores_the_rest_and_restores_the_alarm_handler():
    import signal

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        r = RewardRunner(RewardConfig(num_workers=0, timeout_s=0.3, reward_fn=f"{HELPERS}:sleeps_on_slow"))
        start = time.monotonic()
        out = r.score(["x", "slow", "y"], ["x", "slow", "q"])
        assert time.monotonic() - start < 3
        assert [x["score"] for x in out] == [1.0, 0.0, 0.0]
        assert out[1]["reward_error"].startswith("timeout") and out[2]["reward_error"] is None
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_in_process_limit_is_per_sample_not_per_batch():
    """Three samples of 0.3 s each under a 0.5 s limit all finish (each has its own limit, though the
    batch runs past it); a slow one after them still times out, and a sample after that gets a full limit."""
    r = RewardRunner(RewardConfig(num_workers=0, timeout_s=0.5, reward_fn=f"{HELPERS}:sleeps_its_seconds"))
    solutions = ["sleep 0.3"] * 3 + ["sleep 30", "sleep 0.3", "a"]
    start = time.monotonic()
    out = r.score(solutions, ["a"] * 6)
    assert time.monotonic() - start < 5
    assert [x["score"] for x in out] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert out[3]["reward_error"].startswith("timeout") and all(x["reward_error"] is None for x in out[:3] + out[4:])


def test_in_process_limit_holds_after_a_reward_fn_that_stops_every_alarm():
    """A fn with its own alarm (math-verify's way) ends with `alarm(0)`; the next slow sample still times out."""
    r = RewardRunner(RewardConfig(num_workers=0, timeout_s=0.3, reward_fn=f"{HELPERS}:keeps_its_own_alarm"))
    start = time.monotonic()
    out = r.score(["a", "b", "sleep 0.8"], ["a", "a", "a"])
    assert [x["score"] for x in out] == [1.0, 0.0, 0.0] and out[2]["reward_error"].startswith("timeout")
    assert time.monotonic() - start < 0.75


def test_unknown_data_source_fails_before_scoring_naming_the_fix():
    r = RewardRunner(RewardConfig(num_workers=0))
    with pytest.raises(ValueError, match="no reward for data_source 'mystery'.*data_source_rewards"):
        r.score(["a"], ["a"], ["mystery"])


def test_data_source_rewards_maps_custom_source():
    r = RewardRunner(RewardConfig(num_workers=0, data_source_rewards={"my_math": "math"}))
    assert r.score(["\\boxed{3}"], ["3"], ["my_math"])[0]["score"] == 1.0


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 solutions but 1 ground truths"):
        RewardRunner(RewardConfig(num_workers=0, reward_fn="math")).score(["a", "b"], ["a"])


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="RewardConfig.num_workers"):
        RewardConfig(num_workers=-1)
    with pytest.raises(ValueError, match="RewardConfig.timeout_s"):
        RewardConfig(timeout_s=0)


def test_batch_reward_fn_scores_the_whole_call_at_once_and_keeps_its_extra_keys():
    config = RewardConfig(batch_reward_fn=f"{HELPERS}:judge_batch", num_workers=0)
    out = RewardRunner(config).score(["7", "8", "9"], ["7", "7", "9"], ["math", "math", "code"], [{"id": 1}, {}, {}])
    assert [r["score"] for r in out] == [1.0, 0.0, 1.0] and [r["batch_size"] for r in out] == [3, 3, 3]
    assert [r["source_seen"] for r in out] == [True, True, False] and all(r["reward_error"] is None for r in out)


def test_batch_reward_fn_that_raises_fails_its_samples_not_the_run_and_a_wrong_length_is_an_error():
    failing = RewardRunner(RewardConfig(batch_reward_fn=f"{HELPERS}:judge_batch", failure_score=-1.0))
    out = failing.score(["boom", "x"], ["x", "x"], ["math", "math"])
    assert [r["score"] for r in out] == [-1.0, -1.0]
    assert "ConnectionError: judge service unreachable" in out[0]["reward_error"]
    short = RewardRunner(RewardConfig(batch_reward_fn=f"{HELPERS}:judge_batch_short"))
    with pytest.raises(ValueError, match=r"judge_batch_short' returned 1 results for 2 samples; it must return one"):
        short.score(["a", "b"], ["a", "b"], ["math", "math"])


def test_batch_reward_fns_register_by_name_and_check_their_signature():
    from megarl.rewards import get_batch_reward_fn, register_batch_reward

    @register_batch_reward("test_all_ones")
    def all_ones(solution_strs, ground_truths, extras):
        return [1.0] * len(solution_strs)

    assert get_batch_reward_fn("test_all_ones") is all_ones
    assert RewardRunner(RewardConfig(batch_reward_fn="test_all_ones")).score(["a"], ["b"])[0]["score"] == 1.0
    with pytest.raises(
        TypeError, match=r"batch reward 'per_sample' must accept \(solution_strs, ground_truths, extras\)"
    ):
        register_batch_reward("per_sample")(lambda solution_str, ground_truth: 0.0)
    with pytest.raises(ValueError, match="set reward_fn .* or batch_reward_fn"):
        RewardConfig(reward_fn="arithmetic", batch_reward_fn="test_all_ones")
