"""Critic loss: clipped value regression (PPO's value clipping).

Same shape as the policy losses: `value_loss(inputs, cfg, agg) -> (loss, stats)`, normalised by the
step's global denominators (aggregation.py). Imports only torch.
"""

from dataclasses import dataclass

import torch

from megarl.algorithms.aggregation import LossAggregation, aggregate_loss
from megarl.algorithms.masked import masked_mean, zero_masked


@dataclass
class ValueLossConfig:
    """Knobs of the critic loss."""

    value_clip: float | None = 0.2
    """New values may move at most this far from the old ones before the loss stops pulling; None: off."""


@dataclass
class ValueLossInputs:
    """Per-token tensors the critic loss reads, all [B, T] over response tokens."""

    values: torch.Tensor
    """V_θ(s_t) of the critic being trained (carries the gradient)."""
    old_values: torch.Tensor
    """V(s_t) from the rollout-time critic (the clip centre)."""
    returns: torch.Tensor
    """Regression targets R_t from the advantage estimator."""
    response_mask: torch.Tensor
    """1 where the token gets a loss."""


def value_loss(inputs: ValueLossInputs, cfg: ValueLossConfig, agg: LossAggregation):
    """½ · max((V − R)², (V_clip − R)²),  V_clip = V_old + clip(V − V_old, −ε, ε).

    Stats: vf_clipfrac (the clipped branch is the larger), vpred_mean.
    """
    mask = inputs.response_mask.bool()
    values = zero_masked(inputs.values, mask)
    returns = zero_masked(inputs.returns, mask)
    vf_losses1 = (values - returns) ** 2
    if cfg.value_clip is None:
        vf_losses, clipfrac = vf_losses1, torch.zeros((), device=values.device)
    else:
        old_values = zero_masked(inputs.old_values, mask)
        clipped = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        vf_losses2 = (clipped - returns) ** 2
        vf_losses = torch.maximum(vf_losses1, vf_losses2)
        clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    loss = 0.5 * aggregate_loss(vf_losses, mask, agg)
    stats = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": clipfrac.detach(),
        "vpred_mean": masked_mean(values.detach(), mask),
    }
    return loss, stats
