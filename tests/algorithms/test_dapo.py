"""DAPO: group filtering, dynamic sampling loop, soft overlong penalty, overlong filtering."""

import numpy as np
import pytest
import torch

from megarl.algorithms.dapo import dynamic_sample, filter_groups, mask_truncated, overlong_penalty
from megarl.data.batch import Batch


def test_filter_groups_drops_zero_variance_groups_in_any_row_order():
    scores = torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0, 2.0])
    keep = filter_groups(scores, ["a", "b", "a", "c", "b", "c"])
    assert keep.tolist() == [False, True, False, False, True, False]


def test_filter_groups_drops_single_row_groups():
    assert filter_groups(torch.tensor([1.0, 0.5, 0.7]), torch.tensor([0, 1, 1])).tolist() == [False, True, True]


def rollout(round_index, groups):
    """A generated batch: `groups` is a list of per-group score lists; uid fresh per round."""
    uids = [f"r{round_index}-g{g}" for g, scores in enumerate(groups) for _ in scores]
    scores = [s for group in groups for s in group]
    return Batch.from_dict({"token_level_scores": torch.tensor([[0.0, s] for s in scores])}, {"uid": uids})


def test_dynamic_sample_accumulates_until_target_and_trims_to_exactly_target_groups():
    rounds = iter(
        [
            rollout(0, [[1, 1], [0, 1], [0, 0]]),  # 1 group with signal
            rollout(1, [[1, 0], [1, 1], [0, 1]]),  # 2 more, target reached
            rollout(2, [[1, 0]]),  # never needed
        ]
    )
    batch, generations = dynamic_sample(lambda: next(rounds), target_prompts=2, max_generations=5)
    assert generations == 2
    assert list(batch["uid"]) == ["r0-g1", "r0-g1", "r1-g0", "r1-g0"]
    assert batch["token_level_scores"][:, 1].tolist() == [0, 1, 1, 0]


def test_dynamic_sample_gives_up_with_a_message_naming_the_knobs():
    with pytest.raises(RuntimeError, match="kept 0 of 2 prompt groups after 3 generations; raise max_generations"):
        dynamic_sample(lambda: rollout(0, [[1, 1]]), target_prompts=2, max_generations=3)


def test_dynamic_sample_accepts_per_row_scores_and_int_ids():
    batch = Batch.from_dict({"acc": torch.tensor([1.0, 0.0, 1.0, 1.0]), "uid": torch.tensor([5, 5, 6, 6])})
    kept, generations = dynamic_sample(lambda: batch, 1, 1, score_key="acc")
    assert generations == 1 and kept["uid"].tolist() == [5, 5]


def test_overlong_penalty_linear_inside_buffer():
    # L_max = 20, buffer 5: free up to 15, then −(L − 15)/5, −1 at 20 and beyond
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_response_len=20, buffer_len=5, penalty_factor=0.5)
    torch.testing.assert_close(penalty, 0.5 * torch.tensor([0, 0, -0.2, -0.6, -1.0, -1.0]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_response_len=10, buffer_len=0)


def test_mask_truncated_zeroes_rows_of_truncated_responses():
    mask = torch.ones(3, 4, dtype=torch.int64)
    filtered = mask_truncated(mask, torch.tensor([False, True, False]))
    assert filtered.sum(-1).tolist() == [4, 0, 4] and filtered.dtype == mask.dtype
    assert np.array_equal(mask.numpy(), np.ones((3, 4)))  # input untouched
