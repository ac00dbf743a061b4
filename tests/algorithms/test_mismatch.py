"""Rollout/train mismatch: truncated importance weights at three levels, and mismatch metrics."""

import math

import pytest
import torch

from megarl.algorithms.mismatch import mismatch_metrics, truncated_is_weights

# per-token π_train / π_rollout = [3, .5], third token is padding with garbage
TRAIN = torch.tensor([[math.log(0.6), math.log(0.1), math.nan]], dtype=torch.float64)
ROLLOUT = torch.tensor([[math.log(0.2), math.log(0.2), 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    "level, expected",
    [
        ("token", [2.0, 0.5, 0.0]),  # min(r_t, 2)
        ("sequence", [1.5, 1.5, 0.0]),  # min(3 · .5, 2)
        ("geometric", [math.sqrt(1.5), math.sqrt(1.5), 0.0]),  # min(√(3 · .5), 2)
    ],
)
def test_truncated_is_weights_hand_computed(level, expected):
    weights, _ = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level=level)
    torch.testing.assert_close(weights, torch.tensor([expected], dtype=torch.float64))
    assert not weights.requires_grad


def test_sequence_weight_is_truncated_at_cap():
    train = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    weights, stats = truncated_is_weights(train, train - math.log(3), torch.ones(1, 2), cap=5.0, level="sequence")
    torch.testing.assert_close(weights, torch.full((1, 2), 5.0, dtype=torch.float64))  # 9 → 5
    assert stats["is_clipfrac"].item() == 1.0


def test_token_weights_stats_report_truncated_share():
    _, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="token")
    assert stats["is_clipfrac"].item() == pytest.approx(0.5)
    assert stats["is_weight_mean"].item() == pytest.approx(1.25)


def test_unknown_level_and_bad_cap_raise():
    with pytest.raises(ValueError, match="geometric, sequence, token"):
        truncated_is_weights(TRAIN, ROLLOUT, MASK, level="tok")
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=0.0)


def test_mismatch_metrics_hand_computed():
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    assert metrics["mismatch_abs_mean"].item() == pytest.approx((math.log(3) + math.log(2)) / 2)
    assert metrics["mismatch_abs_max"].item() == pytest.approx(math.log(3))
    # k3 = r − 1 − log r: r = 3 → 2 − log 3;  r = .5 → −.5 + log 2
    expected_k3 = ((2 - math.log(3)) + (-0.5 + math.log(2))) / 2
    assert metrics["mismatch_k3_kl"].item() == pytest.approx(expected_k3)


def test_identical_log_probs_give_zero_mismatch_and_unit_weights():
    lp = torch.randn(3, 5, dtype=torch.float64)
    metrics = mismatch_metrics(lp, lp, torch.ones(3, 5))
    assert all(v.item() == 0 for v in metrics.values())
    weights, _ = truncated_is_weights(lp, lp, torch.ones(3, 5), level="sequence")
    assert torch.all(weights == 1)
