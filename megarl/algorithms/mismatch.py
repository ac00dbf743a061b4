"""Rollout/train mismatch: truncated importance weights and mismatch metrics.

The rollout engine (vLLM) samples with π_rollout; the trainer recomputes log-probs with π_train of
the same weights, and the two differ (kernels, precision, MoE routing). Truncated importance
sampling (TIS; Yao et al. 2025) multiplies the policy loss by w = min(π_train / π_rollout, C),
detached, at one of three levels:

    token      w_t = min(exp(log π_train,t − log π_rollout,t), C)
    sequence   w_i = min(Π_t π_train,t / π_rollout,t, C)               (product of token ratios)
    geometric  w_i = min(exp(mean_t (log π_train,t − log π_rollout,t)), C)   (geometric mean)

Sequence-level weights are the same for every token of the row. Pass the result as
`PolicyLossInputs.is_weights`. Imports only torch.
"""

import math
from dataclasses import dataclass

import torch

from megarl.algorithms.masked import masked_mean, masked_sum, zero_masked
from megarl.utils.registry import Registry

IS_LEVELS = Registry("importance-weight level", ("log_ratio", "mask"))


@dataclass
class MismatchConfig:
    """Rollout/train mismatch correction."""

    level: str | None = None
    """None (off), token, sequence (product of ratios) or geometric (geometric mean)."""
    cap: float = 2.0
    """C: importance weights are truncated to at most this."""


@IS_LEVELS.register("token")
def _token(log_ratio, mask):
    return log_ratio


@IS_LEVELS.register("sequence")
def _sequence(log_ratio, mask):
    return masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)


@IS_LEVELS.register("geometric")
def _geometric(log_ratio, mask):
    return masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)


def truncated_is_weights(log_probs_train, log_probs_rollout, response_mask, cap: float = 2.0, level: str = "token"):
    """Detached weights [B, T] = min(π_train / π_rollout, cap) at `level`; 0 off the mask.

    Returns (weights, stats) with is_weight_mean and is_clipfrac (share of tokens truncated).
    """
    mask = response_mask.bool()
    log_ratio = zero_masked(log_probs_train.detach() - log_probs_rollout.detach(), mask)
    if cap <= 0:
        raise ValueError(f"importance-weight cap must be > 0; got {cap}")
    log_weights = IS_LEVELS.get(level)(log_ratio, mask)
    weights = zero_masked(torch.exp(log_weights.clamp(max=math.log(cap))), mask)
    truncated = (log_weights > math.log(cap)) & mask
    stats = {"is_weight_mean": masked_mean(weights, mask), "is_clipfrac": masked_mean(truncated.float(), mask)}
    return weights, stats


def mismatch_metrics(log_probs_train, log_probs_rollout, response_mask) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the rollout engine's, over response tokens.

    mismatch_abs_mean / mismatch_abs_max: mean / max |log π_train − log π_rollout|;
    mismatch_k3_kl: k3 estimate of KL(π_rollout ‖ π_train) on the rollout's own samples,
    mean over tokens of r − 1 − log r with r = π_train / π_rollout.
    """
    mask = response_mask.bool()
    log_ratio = zero_masked(log_probs_train.detach() - log_probs_rollout.detach(), mask)
    diff = log_ratio.abs()
    k3 = torch.expm1(log_ratio.clamp(-20, 20)) - log_ratio
    return {
        "mismatch_abs_mean": masked_mean(diff, mask),
        "mismatch_abs_max": diff.max() if diff.numel() else diff.sum(),
        "mismatch_k3_kl": masked_mean(k3, mask),
    }
