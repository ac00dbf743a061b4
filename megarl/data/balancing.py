"""Row balancing: split rows across DP ranks by token count, pack micro-batches by a token budget,
and measure imbalance.

Everything works on row indices and lengths only (callers index the Batch with the result), so
this module imports nothing beyond numpy and the standard library (no torch, megatron, vLLM, Ray).

Row-count rule of `balance_rows`: the units dealt out are rows, or whole groups with
`keep_groups=True`; every rank gets ⌊n/k⌋ or ⌈n/k⌉ units (n units, k ranks). So ranks get the
same number of rows whenever k divides the number of rows (or, keeping groups, the number of
groups, all groups being the same size — e.g. samples_per_prompt rows each).
"""

import heapq
import itertools
import warnings
from typing import Sequence

import numpy as np

Lengths = Sequence[int] | np.ndarray


def balance_rows(
    lengths: Lengths, num_ranks: int, group_ids: Sequence | np.ndarray | None = None, keep_groups: bool = False
) -> list[list[int]]:
    """Row indices per rank (each list ascending) with token counts balanced.

    Karmarkar–Karp largest differencing over units (rows, or groups when keep_groups) under the
    equal-unit-count rule in the module docstring. lengths: tokens per row [N].
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if keep_groups:
        units = _units(len(lengths), group_ids)
        weights = [int(lengths[rows].sum()) for rows in units]
    else:  # each row its own unit: the weights are the lengths, a part's units its rows
        units, weights = None, lengths.tolist()
    if len(weights) < num_ranks:
        raise ValueError(
            f"cannot give each of {num_ranks} ranks work from {len(weights)} "
            f"{'groups' if keep_groups else 'rows'}; lower the DP size or raise prompts_per_step"
        )
    parts = _karmarkar_karp(weights, num_ranks)
    if units is None:
        return [sorted(part) for part in parts]
    return [sorted(int(row) for unit in part for row in units[unit]) for part in parts]


def _units(num_rows: int, group_ids) -> list[np.ndarray]:
    """Rows dealt as one: the rows of each group in order of first appearance."""
    if group_ids is None:
        raise ValueError("keep_groups=True needs group_ids (one id per row)")
    ids = np.asarray(group_ids).reshape(-1)
    if len(ids) != num_rows:
        raise ValueError(f"group_ids has {len(ids)} entries for {num_rows} rows")
    _, first, codes = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(codes.reshape(-1), kind="stable")
    groups = np.split(order, np.cumsum(np.bincount(codes.reshape(-1)))[:-1])
    return [groups[g] for g in np.argsort(first)]


def _karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """k parts of the unit indices, ⌊n/k⌋ or ⌈n/k⌉ units each, with balanced weight sums.

    Units sorted by weight are dealt k at a time into k-part states (padded with weightless
    dummies); the two states with the largest spread are merged, heaviest part with lightest,
    until one state is left (largest differencing method, equal-cardinality variant).
    """
    order = sorted(range(len(weights)), key=lambda u: (weights[u], u))
    order += [-1] * (-len(order) % k)  # dummies: weight 0
    tie = itertools.count()
    heap = []
    for start in range(0, len(order), k):
        state = sorted(([weights[u] if u >= 0 else 0, [u]] for u in order[start : start + k]), reverse=True)
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), next(tie), state))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(([wa + wb, ua + ub] for (wa, ua), (wb, ub) in zip(a, reversed(b))), reverse=True)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [[u for u in units if u >= 0] for _, units in heap[0][2]]


def pack_micro_batches(lengths: Lengths, max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Row indices per micro-batch, each under `max_tokens` tokens (first-fit decreasing).

    A row longer than the budget gets a micro-batch of its own (with a warning); no row is ever
    dropped. With `min_micro_batches` (e.g. agreed across DP ranks) the heaviest micro-batches
    are split until there are that many. Each list is ascending.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        _first_fit(bins, loads, row, int(lengths[row]), max_tokens)
    while len(bins) < min_micro_batches:
        _split_heaviest(bins, loads, lengths)
    return [sorted(b) for b in bins]


def _first_fit(bins: list[list[int]], loads: list[int], row: int, length: int, max_tokens: int) -> None:
    if length > max_tokens:
        warnings.warn(
            f"row {row} has {length} tokens, over the micro-batch budget of {max_tokens}; "
            f"it gets a micro-batch of its own",
            stacklevel=3,
        )
    for i, load in enumerate(loads):
        if load + length <= max_tokens:
            bins[i].append(row)
            loads[i] += length
            return
    bins.append([row])
    loads.append(length)


def _split_heaviest(bins: list[list[int]], loads: list[int], lengths: np.ndarray) -> None:
    """Split the heaviest micro-batch that has at least two rows into two balanced halves."""
    splittable = [i for i, b in enumerate(bins) if len(b) > 1]
    if not splittable:
        raise ValueError(f"cannot make {len(bins) + 1} micro-batches from {sum(map(len, bins))} rows")
    i = max(splittable, key=lambda j: loads[j])
    halves = _karmarkar_karp([int(lengths[r]) for r in bins[i]], 2)
    rows = bins.pop(i)
    loads.pop(i)
    for half in halves:
        bins.append([rows[u] for u in half])
        loads.append(int(lengths[bins[-1]].sum()))


def imbalance(lengths: Lengths, partitions: Sequence[Sequence[int]]) -> float:
    """max / mean tokens across ranks (1.0 is perfect balance)."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    loads = np.array([lengths[list(part)].sum() for part in partitions], dtype=np.float64)
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0
