"""DAPO pieces (Yu et al. 2025): dynamic sampling and overlong-response shaping.

* Dynamic sampling: groups whose rewards are all equal have zero GRPO advantage and only dilute
  the batch; `filter_groups` drops them and `dynamic_sample` keeps generating until enough
  prompts with signal are collected.
* Soft overlong punishment: a linear penalty over the last `buffer_len` tokens before
  `max_response_len`; overlong filtering: truncated responses get no loss at all.

Imports only torch, numpy and megarl.data.batch (no megatron, vLLM or Ray).
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from megarl.algorithms.masked import GroupIds, group_codes
from megarl.data.batch import Batch


@dataclass
class DAPOConfig:
    """Dynamic sampling and overlong shaping."""

    filter_groups: bool = False
    """Drop prompt groups whose rewards have zero variance and generate more (dynamic sampling)."""
    max_generations: int = 10
    """Give up after this many generation rounds per step without enough groups."""
    overlong_buffer_len: int = 0
    """Length of the soft-penalty zone before max_response_len; 0: no overlong penalty."""
    overlong_penalty_factor: float = 1.0
    """Penalty at max_response_len (it grows linearly from 0 across the buffer)."""
    overlong_filter: bool = False
    """Mask truncated responses out of the loss."""


def filter_groups(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Rows [B] bool: True where the row's group has at least two different scores [B]."""
    codes, num_groups = group_codes(group_ids, scores.device)
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, codes, scores, "amax")
    low = low.scatter_reduce(0, codes, scores, "amin")
    return (high > low)[codes]


def dynamic_sample(
    generate: Callable[[], Batch],
    target_prompts: int,
    max_generations: int,
    score_key: str = "token_level_scores",
    group_key: str = "uid",
) -> tuple[Batch, int]:
    """Call `generate` until `target_prompts` groups with reward variance are kept.

    Each call returns a batch whose `group_key` column identifies prompt groups (ids fresh per
    call) and whose `score_key` column is a per-row score [B] or per-token scores [B, T] (summed).
    Returns (exactly target_prompts groups in generation order, number of generate calls).
    """
    kept, groups = [], 0
    for generation in range(1, max_generations + 1):
        batch = generate()
        batch = batch[filter_groups(_row_scores(batch[score_key]), batch[group_key])]
        batch = _first_groups(batch, group_key, target_prompts - groups)
        kept.append(batch)
        groups += len(np.unique(_as_numpy(batch[group_key])))
        if groups >= target_prompts:
            return Batch.concat(kept), generation
    raise RuntimeError(
        f"dynamic sampling kept {groups} of {target_prompts} prompt groups after {max_generations} "
        f"generations; raise max_generations or samples_per_prompt, or turn filter_groups off"
    )


def _row_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores.sum(-1) if scores.ndim == 2 else scores


def _as_numpy(ids) -> np.ndarray:
    return ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)


def _first_groups(batch: Batch, group_key: str, n: int) -> Batch:
    """Rows of the first `n` groups, in order of first appearance."""
    ids = _as_numpy(batch[group_key])
    _, first_row, codes = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first_row))  # group → order of appearance
    return batch[rank[codes.reshape(-1)] < n]


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment per row [B] (add it to the sequence score).

    0 for L ≤ L_max − L_buffer;  (L_max − L_buffer − L) / L_buffer · factor inside the buffer;
    −factor for L ≥ L_max.
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"overlong buffer_len must lie in (0, max_response_len={max_response_len}]; got {buffer_len}")
    expected = max_response_len - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return (-exceed / buffer_len).clamp(-1.0, 0.0) * penalty_factor


def mask_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: response_mask [B, T] with the rows of truncated [B] responses zeroed."""
    return response_mask * ~truncated.bool()[:, None]
