"""Driver pieces without workers: rollout batch assembly, checkpoint bookkeeping, metric sinks."""

import json

import numpy as np
import pytest
import torch

from megarl.agent.single_turn import completion_trajectory
from megarl.agent.trajectory import Trajectory
from megarl.data.batch import Batch
from megarl.rollout.base import Completion, SamplingParams
from megarl.trainer import batching, state
from megarl.trainer.metrics import PhaseTimer, RunLogger, batch_metrics, timing_metrics


def prompts():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    return Batch.from_dict(
        {"input_ids": ids, "attention_mask": (ids > 0).long(), "position_ids": ids},
        {"ground_truth": ["1", "2"], "data_source": ["arithmetic"] * 2},
    )


def test_rollout_batch_appends_right_padded_responses_to_left_padded_prompts():
    reqs = batching.requests(prompts(), SamplingParams(n=2, seed=None), seed=100)
    assert [r[0] for r in reqs] == [[5, 6], [7, 8, 9, 10]] and [r[1].seed for r in reqs] == [100, 101]
    done = [
        [Completion([3], [-0.5], "stop", 4), Completion([4, 3, 3], [-1.0, -2.0, -3.0], "length", 4)],
        [Completion([9, 3], [-0.1, -0.2], "stop", 4)] * 2,
    ]
    trajectories = [[completion_trajectory(ids, c) for c in group] for (ids, _), group in zip(reqs, done)]
    batch = batching.trajectory_batch(prompts(), trajectories, pad_token_id=0, group_prefix="7:")
    assert len(batch) == 4 and "position_ids" not in batch
    assert batch["input_ids"].tolist()[1] == [0, 0, 5, 6, 4, 3, 3]
    assert batch["attention_mask"].tolist()[0] == [0, 0, 1, 1, 1, 0, 0]
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]]
    assert batch["rollout_log_probs"][1].tolist() == [-1.0, -2.0, -3.0]
    assert list(batch["uid"]) == ["7:0", "7:0", "7:1", "7:1"] and list(batch["ground_truth"]) == ["1", "1", "2", "2"]
    assert [batch[k].dtype for k in ("input_ids", "attention_mask", "response_mask", "response_versions")] == [
        torch.long
    ] * 4
    assert batch["rollout_log_probs"].dtype == batch["turn_rewards"].dtype == torch.float32

    class Ids:  # a tokenizer whose text is the ids it decodes
        def batch_decode(self, rows, skip_special_tokens):
            return [" ".join(map(str, ids)) for ids in rows]

    assert batching.decode_responses(batch, Ids()) == ["3", "4 3 3", "9 3", "9 3"]  # the real response tokens
    rewards = batching.outcome_rewards(torch.tensor([1.0, 0.5, 0.0, 2.0]), batch["response_mask"])
    assert rewards.tolist() == [[1, 0, 0], [0, 0, 0.5], [0, 0, 0], [0, 2, 0]]
    assert [len(b) for b in batching.minibatches(batch, 2, epochs=2)] == [2, 2, 2, 2]


def test_a_two_turn_trajectory_becomes_a_row_with_a_hole_and_rewards_on_model_tokens():
    """turn 1 (model: 2 tokens) → tool observation (3 tokens, mask 0) → turn 2 (model: 2 tokens)."""
    tool_turn = Trajectory([5, 6])
    tool_turn.add_model_turn([11, 12], [-0.1, -0.2], version=3)
    tool_turn.reward_turn(0.5)  # e.g. an environment's step reward for turn 1
    tool_turn.add_observation("tool", [20, 21, 22])
    tool_turn.add_model_turn([13, 2], [-0.3, -0.4], version=4)
    tool_turn.finish_reason = "stop"
    short = completion_trajectory([7, 8, 9, 10], Completion([9, 2], [-1.0, -2.0], "stop", 4))
    batch = batching.trajectory_batch(prompts(), [[tool_turn.finalize()], [short]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6, 11, 12, 20, 21, 22, 13, 2], [7, 8, 9, 10, 9, 2, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist()[1] == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert batch["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3, -0.4])
    assert batch["response_versions"].tolist() == [[3, 3, -1, -1, -1, 4, 4], [4, 4, -1, -1, -1, -1, -1]]
    assert batch["policy_version"].tolist() == [3, 4]  # the oldest version among the row's tokens
    assert batch["turn_rewards"][0].tolist() == [0, 0.5, 0, 0, 0, 0, 0]  # on turn 1's last model token
    rewards = batching.outcome_rewards(torch.tensor([1.0, 2.0]), batch["response_mask"])
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1], [0, 2, 0, 0, 0, 0, 0]]  # the last model token
    holes = torch.tensor([[1, 1, 0, 0, 1, 0, 0]])  # a trailing observation after the last model turn
    assert batching.outcome_rewards(torch.tensor([1.0]), holes).tolist() == [[0, 0, 0, 0, 1, 0, 0]]
    assert [t["role"] for t in batch["agent_turns"][0]] == ["assistant", "tool", "assistant"]
    assert batch["agent_turns"][1] is None


def test_rows_without_model_tokens_pad_fully_and_take_policy_version_zero():
    """An aborted request with no tokens, and a trajectory of tool tokens only."""
    empty = completion_trajectory([5, 6], Completion([], [], "abort", 7))
    observed = Trajectory([7, 8, 9, 10])
    observed.add_observation("tool", [20, 21])
    batch = batching.trajectory_batch(prompts(), [[empty], [observed.finalize()]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6, 0, 0], [7, 8, 9, 10, 20, 21]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[0, 0], [0, 0]]
    assert batch["response_versions"].tolist() == [[-1, -1], [-1, -1]]
    assert batch["policy_version"].tolist() == [0, 0]
    assert batch["turn_rewards"].tolist() == [[0, 0], [0, 0]]


def test_long_responses_decode_to_the_same_texts_as_short_ones_do():
    """From `LONG_ROW_TOKENS` on, rows reach the tokenizer as numpy arrays masked in numpy: the same tokens, holes
    (a tool turn, padding) dropped, in the same order as the list path gives them."""
    long = batching.LONG_ROW_TOKENS + 5
    tool_turn = Trajectory([5, 6])
    tool_turn.add_model_turn(list(range(11, 11 + long - 4)), [-0.1] * (long - 4), version=1)
    tool_turn.add_observation("tool", [7, 8])
    tool_turn.add_model_turn([9, 2], [-0.1, -0.2], version=1)
    short = completion_trajectory([7, 8, 9, 10], Completion([9, 2], [-1.0, -2.0], "stop", 1))
    batch = batching.trajectory_batch(prompts(), [[tool_turn.finalize()], [short]], pad_token_id=0)
    assert batch["response_mask"].shape[1] == long

    class Ids:  # a tokenizer whose text is the ids it decodes, and which sees what it is given
        def batch_decode(self, rows, skip_special_tokens):
            assert all(isinstance(ids, np.ndarray) for ids in rows)
            return [" ".join(map(str, ids)) for ids in rows]

    expected = [" ".join(map(str, [*range(11, 11 + long - 4), 7, 8, 9, 2])), "9 2"]
    assert batching.decode_responses(batch, Ids()) == expected


def test_only_checkpoints_with_driver_state_count_and_pruning_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        state.save_driver_state(state.step_dir(tmp_path, step), state.DriverState(step, {"epoch": 0, "position": step}))
    (state.step_dir(tmp_path, 8) / "actor").mkdir(parents=True)  # killed while saving: incomplete
    assert state.latest_checkpoint(tmp_path) == state.step_dir(tmp_path, 6)
    assert state.resolve_resume("auto", tmp_path) == state.step_dir(tmp_path, 6)
    assert state.resolve_resume("never", tmp_path) is None
    with pytest.raises(state.ResumeError, match="not a complete checkpoint"):
        state.resolve_resume(str(state.step_dir(tmp_path, 8)), tmp_path)
    assert state.prune_checkpoints(tmp_path, keep=2) == [state.step_dir(tmp_path, 2)]
    assert state.load_driver_state(state.step_dir(tmp_path, 6)).loader == {"epoch": 0, "position": 6}
    assert not list(state.step_dir(tmp_path, 6).glob(".*tmp*"))


def test_run_logger_writes_jsonl_tensorboard_plot_and_drops_steps_after_a_resume(tmp_path):
    from megarl.config import RunConfig

    cfg = RunConfig()
    cfg.trainer.run_dir, cfg.trainer.progress_bar = str(tmp_path), False
    log = RunLogger(cfg)
    for step in range(4):
        log.log(step, {"reward/score/mean": 0.1 * step, "val/score": 0.2 * step}, advance=step > 0)
    log.close()
    resumed = RunLogger(cfg, start_step=2)  # a run killed after its step-2 checkpoint logged step 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert resumed.plot().stat().st_size > 0 and list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    resumed.close()


def test_step_metrics_and_driver_overhead_share():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = Batch.from_dict(
        {
            "response_mask": mask,
            "attention_mask": torch.ones(2, 5),
            "scores": torch.tensor([1.0, 0.0]),
            "advantages": torch.tensor([[1.0, 1.0, 9.0], [-1.0, 9.0, 9.0]]),
            "old_log_probs": torch.zeros(2, 3),
            "rollout_log_probs": torch.full((2, 3), -0.1),
        },
        {"finish_reason": np.array(["stop", "length"], dtype=object)},
    )
    m = batch_metrics(batch)
    assert m["reward/score/mean"] == 0.5 and m["response_length/mean"] == 1.5
    assert m["response_length/clip_ratio"] == 0.5 and m["advantages/max"] == 1.0  # masked tokens ignored
    assert m["rollout/mismatch_abs_mean"] == pytest.approx(0.1)
    timer = PhaseTimer()
    timer.seconds = {"generate": 0.0, "reward": 0.0}
    t = timing_metrics(timer, batch)
    assert 0.99 <= t["time/driver_overhead_share"] <= 1.0 and t["perf/tokens_per_s"] > 0


def scored(scores, acc, sources, uids, infos=None):
    """A scored batch as `RLTrainer.score` leaves it (response mask of one token per row)."""
    n = len(scores)
    return Batch.from_dict(
        {"scores": torch.tensor(scores), "acc": torch.tensor(acc), "response_mask": torch.ones(n, 1)},
        {"data_source": sources, "uid": uids, "reward_info": infos or [{}] * n},
    )


def test_every_key_a_reward_fn_returns_is_logged_overall_and_per_data_source():
    batch = scored(
        [1.0, 0.0, 0.5, 0.0],
        [1.0, 0.0, 1.0, 0.0],
        ["math", "math", "code", "code"],
        list("abcd"),
        [
            {"format": 1.0, "reward_error": None},
            {"format": 0.0, "reward_error": "boom"},
            {"format": True, "tests_passed": 3, "note": "text"},
            {"format": False, "tests_passed": 1},
        ],
    )
    m = batch_metrics(
        Batch.from_dict(
            {**batch.tensors, "response_mask": torch.ones(4, 1)},
            {**batch.non_tensors, "finish_reason": np.array(["stop"] * 4)},
        )
    )
    assert m["reward/format"] == 0.5 and m["reward/tests_passed"] == 2.0 and "reward/note" not in m
    assert m["reward/math/score"] == 0.5 and m["reward/code/score"] == 0.25
    assert m["reward/math/acc"] == 0.5 and m["reward/code/acc"] == 0.5
    assert m["reward/math/format"] == 0.5 and m["reward/code/format"] == 0.5 and m["reward/code/tests_passed"] == 2.0
    assert "reward/math/tests_passed" not in m and "reward/reward_error" not in m  # only rows that returned it
    assert m["reward/error_rate"] == 0.25  # one row's reward fn failed


def test_validation_reports_mean_and_pass_at_n_overall_and_per_data_source():
    from megarl.trainer.metrics import validation_metrics

    # two prompts of math (one solved once in 2 samples, one never), one of code (solved twice)
    batch = scored(
        [1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        [1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        ["math"] * 4 + ["code"] * 2,
        ["p0", "p0", "p1", "p1", "p2", "p2"],
    )
    m = validation_metrics(batch, n=2)
    assert m["val/acc"] == m["val/acc/mean@2"] == pytest.approx(0.5) and m["val/acc/pass@2"] == pytest.approx(2 / 3)
    assert m["val/math/acc"] == 0.25 and m["val/math/acc/pass@2"] == 0.5 and m["val/code/acc/pass@2"] == 1.0
    assert m["val/code/score"] == 1.0 and m["val/response_length"] == 1.0
    one = validation_metrics(scored([1.0, 0.0], [1.0, 0.0], ["math"] * 2, ["p0", "p1"]), n=1)
    assert one["val/acc"] == 0.5 and not any("@" in k for k in one)


def test_validation_sampling_is_its_own_greedy_or_sampled_with_fallbacks_to_the_rollout():
    from types import SimpleNamespace

    from megarl.config.schema import ValidationConfig
    from megarl.trainer.loop import validation_sampling

    train = SamplingParams(temperature=1.0, top_p=0.9, top_k=5, max_tokens=4, n=8)
    greedy = validation_sampling(SimpleNamespace(validation=ValidationConfig(samples_per_prompt=2)), train)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.n, greedy.max_tokens) == (0.0, 1.0, 0, 2, 4)
    own = ValidationConfig(greedy=False, temperature=0.6, samples_per_prompt=4)
    sampled = validation_sampling(SimpleNamespace(validation=own), train)
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.n) == (0.6, 0.9, 5, 4)


def test_zero_variance_warning_comes_once_after_n_steps_in_a_row_with_most_groups_flat():
    from megarl.trainer.metrics import ZeroVarianceWatch

    watch = ZeroVarianceWatch(steps=3)
    shares = [0.9, 0.9, 0.2, 0.6, 0.75, 1.0, 1.0, 1.0]  # the 0.2 breaks the first run
    said = [watch.update({"rollout/zero_variance_groups": s, "reward/score/mean": 0.97}) for s in shares]
    assert [i for i, w in enumerate(said) if w] == [5]
    assert "more than half of the prompt groups" in said[5] and "rollout/zero_variance_groups=1.00" in said[5]
    assert "rollout.samples_per_prompt" in said[5] and "trainer.zero_variance_warn_steps" in said[5]
    off = ZeroVarianceWatch(steps=0)
    assert not any(off.update({"rollout/zero_variance_groups": 1.0}) for _ in range(20))
    assert ZeroVarianceWatch(steps=1).update({}) is None  # no groups (no uid column): nothing to say
