"""Loss aggregation modes: hand-computed values, and exact invariance to any shard/micro-batch split."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms.aggregation import LossAggregation, aggregate_loss, loss_denominators

FAST = settings(max_examples=50, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 has no loss tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 7 / 2),  # (3 + 4) / 2 non-empty rows
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 4)),  # max_response_len = 4
    ],
)
def test_aggregation_hand_computed(mode, expected):
    agg = LossAggregation(mode, max_response_len=4)
    assert aggregate_loss(LOSS, MASK, agg).item() == pytest.approx(expected)


def test_for_batch_counts_tokens_and_non_empty_rows():
    agg = LossAggregation.for_batch("token-mean", MASK)
    assert (agg.global_tokens, agg.global_seqs) == (3.0, 2.0)
    assert [int(x) for x in loss_denominators(MASK)] == [3, 2]


def test_global_denominators_override_local_counts():
    agg = LossAggregation("token-mean", global_tokens=6.0)
    assert aggregate_loss(LOSS, MASK, agg).item() == pytest.approx(7 / 6)


def test_unknown_mode_and_missing_max_len_raise():
    with pytest.raises(ValueError, match="valid names"):
        LossAggregation("token-sum")
    with pytest.raises(ValueError, match="max_response_len"):
        LossAggregation("seq-mean-token-sum-norm")


def test_garbage_in_masked_positions_does_not_leak():
    loss = LOSS.clone()
    loss[MASK == 0] = float("nan")
    for mode in MODES:
        agg = LossAggregation(mode, max_response_len=4)
        assert aggregate_loss(loss, MASK, agg) == aggregate_loss(LOSS, MASK, agg)


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(1, 12),
    T=st.integers(1, 16),
    cuts=st.lists(st.integers(0, 12), max_size=5),
    mode=st.sampled_from(MODES),
)
def test_sum_of_shard_losses_and_grads_equals_unsplit(seed, B, T, cuts, mode):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.4
    loss_mat = torch.randn(B, T, generator=gen, dtype=torch.float64).requires_grad_(True)
    agg = LossAggregation.for_batch(mode, mask, max_response_len=T)

    full = aggregate_loss(loss_mat, mask, agg)
    (full_grad,) = torch.autograd.grad(full, loss_mat)

    bounds = sorted({0, B, *[c for c in cuts if c < B]})
    sharded = sum(aggregate_loss(loss_mat[a:b], mask[a:b], agg) for a, b in zip(bounds[:-1], bounds[1:]))
    (shard_grad,) = torch.autograd.grad(sharded, loss_mat)

    assert abs(sharded.item() - full.item()) <= 1e-6
    torch.testing.assert_close(shard_grad, full_grad, atol=1e-6, rtol=0)
