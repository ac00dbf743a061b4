"""Masked tensor helpers shared by the algorithms: zeroing padding, masked sum/mean/whitening,
group ids → dense group codes, and per-group statistics.

Padding is never trusted: `zero_masked` uses `torch.where`, so NaN or inf in masked positions
cannot leak into a result or its gradient. Imports only torch and numpy.
"""

from typing import Sequence

import numpy as np
import torch

GroupIds = torch.Tensor | np.ndarray | Sequence


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` where `mask` is set, exactly 0 elsewhere (also for NaN/inf); gradient 0 there too."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over masked positions (over all dims, or over `dim`)."""
    x = zero_masked(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over masked positions; 0 where nothing is masked in."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps), mean and unbiased variance over masked positions; 0 elsewhere."""
    mask = mask.bool()
    return whiten_zeroed(zero_masked(x, mask), mask.to(x.dtype), eps)


def whiten_zeroed(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`masked_whiten` of x that is already 0 off the mask; weight is the mask in x's dtype."""
    count = torch.count_nonzero(weight).clamp(min=1)  # exact for any size
    centered = (x - x.sum() / count).mul_(weight)
    flat = centered.view(-1)
    var = torch.dot(flat, flat) / (count - 1).clamp(min=1)
    return centered.mul_(torch.rsqrt(var + eps).to(x.dtype))


def group_codes(group_ids: GroupIds, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Per-row group ids (ints or strings, in any order) → (codes [B] int64 in [0, G), G)."""
    if isinstance(group_ids, torch.Tensor):
        _, codes = torch.unique(group_ids, return_inverse=True)
        num_groups = int(codes.max()) + 1 if codes.numel() else 0
        return codes.to(device or codes.device), num_groups
    uniques, codes = np.unique(np.asarray(group_ids), return_inverse=True)
    return torch.as_tensor(codes.reshape(-1), dtype=torch.int64, device=device), len(uniques)


def group_sum(x: torch.Tensor, codes: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums of row values x [B] → [G]."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, codes, x)


def group_mean_std(x: torch.Tensor, codes: torch.Tensor, num_groups: int):
    """Per-row (mean, unbiased std, size) of the row's group. x, codes: [B] → three [B] tensors.

    A group of one has std 0.
    """
    size = group_sum(torch.ones_like(x), codes, num_groups)
    mean = group_sum(x, codes, num_groups) / size
    centered = x - mean[codes]
    var = group_sum(centered * centered, codes, num_groups) / (size - 1).clamp(min=1)
    return mean[codes], var.sqrt()[codes], size[codes]
