"""Balancing rows across DP ranks and packing micro-batches by a token budget."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.balancing import balance_rows, imbalance, pack_micro_batches

FAST = settings(max_examples=50, deadline=None)


def contiguous_split(num_rows, num_ranks):
    return [list(part) for part in np.array_split(np.arange(num_rows), num_ranks)]


def skewed_lengths(num_rows, seed=0):
    """Long-tailed lengths capped at 4096 (like responses hitting the limit), longest first."""
    rng = np.random.default_rng(seed)
    return np.sort(np.minimum(rng.lognormal(6.0, 1.0, num_rows), 4096)).astype(np.int64)[::-1]


def assert_each_row_once(parts, num_rows):
    assert sorted(row for part in parts for row in part) == list(range(num_rows))


def test_balanced_imbalance_is_at_most_the_contiguous_split_on_skewed_lengths():
    lengths = skewed_lengths(256)
    parts = balance_rows(lengths, 8)
    assert imbalance(lengths, parts) <= imbalance(lengths, contiguous_split(256, 8))
    assert imbalance(lengths, parts) < 1.05


def test_equal_rows_per_rank_when_ranks_divide_rows():
    parts = balance_rows(skewed_lengths(64), 8)
    assert [len(p) for p in parts] == [8] * 8
    assert_each_row_once(parts, 64)


def test_row_counts_differ_by_at_most_one_when_ranks_do_not_divide_rows():
    parts = balance_rows(skewed_lengths(10), 4)
    assert sorted(len(p) for p in parts) == [2, 2, 3, 3]
    assert_each_row_once(parts, 10)


def test_hand_case_four_rows_two_ranks_pairs_long_with_short():
    parts = balance_rows([10, 1, 9, 2], 2)
    assert sorted(parts) == [[0, 1], [2, 3]]
    assert imbalance([10, 1, 9, 2], parts) == pytest.approx(11 / 11)


def test_keep_groups_puts_each_group_on_one_rank_with_equal_rows():
    samples_per_prompt = 4
    group_ids = np.repeat([f"g{i}" for i in range(16)], samples_per_prompt)
    rng = np.random.default_rng(1)
    lengths = rng.integers(10, 1000, len(group_ids))
    parts = balance_rows(lengths, 4, group_ids=group_ids, keep_groups=True)
    assert_each_row_once(parts, len(group_ids))
    assert [len(p) for p in parts] == [16] * 4
    rank_of_group = {}
    for rank, part in enumerate(parts):
        for row in part:
            assert rank_of_group.setdefault(group_ids[row], rank) == rank


def test_keep_groups_without_group_ids_raises():
    with pytest.raises(ValueError, match="group_ids"):
        balance_rows([1, 2], 2, keep_groups=True)


def test_fewer_units_than_ranks_raises_naming_the_fix():
    with pytest.raises(ValueError, match="lower the DP size"):
        balance_rows([5, 5, 5], 4)


@FAST
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=80),
    num_ranks=st.integers(1, 8),
    group_size=st.integers(1, 4),
    keep_groups=st.booleans(),
)
def test_every_row_assigned_exactly_once_and_unit_counts_within_one(lengths, num_ranks, group_size, keep_groups):
    group_ids = [i // group_size for i in range(len(lengths))]
    num_units = len(set(group_ids)) if keep_groups else len(lengths)
    if num_units < num_ranks:
        return
    parts = balance_rows(lengths, num_ranks, group_ids=group_ids, keep_groups=keep_groups)
    assert len(parts) == num_ranks
    assert_each_row_once(parts, len(lengths))
    units = [len({group_ids[r] for r in p}) if keep_groups else len(p) for p in parts]
    assert max(units) - min(units) <= 1
    assert all(p == sorted(p) for p in parts)


@FAST
@given(lengths=st.lists(st.integers(1, 3000), min_size=8, max_size=80), num_ranks=st.integers(2, 8))
def test_balanced_never_worse_than_lpt_bound(lengths, num_ranks):
    parts = balance_rows(lengths, num_ranks)
    loads = [sum(lengths[r] for r in p) for p in parts]
    # any partition's max load is at least max(mean, longest row); KK stays within that + longest row
    assert max(loads) <= sum(lengths) / num_ranks + max(lengths)


@FAST
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=80), budget=st.integers(500, 4000))
def test_micro_batches_respect_budget_and_keep_every_row(lengths, budget):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bins = pack_micro_batches(lengths, budget)
    assert_each_row_once(bins, len(lengths))
    for b in bins:
        assert sum(lengths[r] for r in b) <= budget or len(b) == 1


def test_first_fit_decreasing_hand_case():
    assert pack_micro_batches([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]


def test_row_over_budget_gets_its_own_micro_batch_with_warning():
    with pytest.warns(UserWarning, match="row 1 has 50 tokens"):
        bins = pack_micro_batches([5, 50, 5], 20)
    assert sorted(bins) == [[0, 2], [1]]


def test_min_micro_batches_splits_heaviest_until_count_reached():
    bins = pack_micro_batches([3, 3, 2, 2], 100, min_micro_batches=3)
    assert len(bins) == 3
    assert_each_row_once(bins, 4)


def test_min_micro_batches_above_row_count_raises():
    with pytest.raises(ValueError, match="cannot make 3 micro-batches from 2 rows"):
        pack_micro_batches([3, 3], 100, min_micro_batches=3)


def test_imbalance_is_max_over_mean():
    assert imbalance([4, 2, 2], [[0], [1, 2]]) == pytest.approx(1.0)
    assert imbalance([6, 1, 1], [[0], [1, 2]]) == pytest.approx(6 / 4)
