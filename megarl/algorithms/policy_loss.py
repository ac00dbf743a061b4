"""Policy losses, registered by name in `POLICY_LOSSES`, and the entropy bonus.

Every policy loss has the same signature

    fn(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation) -> (loss, stats)

`loss` is a scalar normalised by the step's global denominators (see aggregation.py), so losses of
micro-batches and DP shards add up to the full-step loss. `stats` holds detached 0-dim tensors
(no host sync), means over this call's response tokens. Padding is sanitised first: NaN or inf in
masked-out positions changes neither the loss nor its gradient.

Imports only torch (no megatron, vLLM or Ray).
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from megarl.algorithms.aggregation import LossAggregation, aggregate_loss
from megarl.algorithms.masked import masked_mean, zero_masked
from megarl.utils.registry import Registry

POLICY_LOSSES = Registry("policy loss", ("inputs", "cfg", "agg"))
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get

Stats = dict[str, torch.Tensor]


@dataclass
class PolicyLossConfig:
    """Knobs of the policy losses (each loss reads the ones it needs)."""

    name: str = "ppo_clip"
    """Name in POLICY_LOSSES: ppo_clip, gspo, cispo, decoupled_ppo (or 'pkg.module:fn')."""
    clip_ratio_low: float = 0.2
    """ε_low: the ratio (CISPO: the IS weight) is clipped below at 1 − ε_low; ≥ 1 disables."""
    clip_ratio_high: float = 0.2
    """ε_high: clipped above at 1 + ε_high (DAPO clip-higher uses 0.28; GSPO ~4e-4)."""
    clip_ratio_c: float | None = None
    """Dual-clip bound c > 1 (Ye et al. 2020): for A < 0 the loss is capped at −A·c; None: off."""
    log_ratio_clamp: float = 20.0
    """|log π_θ − log π_old| is clamped to this before exp, so the ratio never overflows."""
    behaviour_weight_cap: float = 5.0
    """decoupled_ppo: the proximal/behaviour weight π_prox/π_behav is capped at this (AReaL's
    behav_imp_weight_cap)."""
    behaviour_weight_mode: str = "truncate"
    """decoupled_ppo: truncate weights above the cap to the cap, or mask (drop) those tokens."""

    def __post_init__(self):
        if self.behaviour_weight_cap <= 0 or self.behaviour_weight_mode not in ("truncate", "mask"):
            raise ValueError(
                f"behaviour_weight_cap must be > 0 (got {self.behaviour_weight_cap}) and"
                f" behaviour_weight_mode truncate or mask (got {self.behaviour_weight_mode!r})"
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip); got {self.clip_ratio_c}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError("clip_ratio_low and clip_ratio_high must be >= 0")


@dataclass
class PolicyLossInputs:
    """Per-token tensors a policy loss reads, all [B, T] over response tokens."""

    log_probs: torch.Tensor
    """log π_θ(a_t|s_t) of the policy being trained (carries the gradient)."""
    old_log_probs: torch.Tensor
    """log π_old of the policy the ratio is taken against (behaviour, or proximal when decoupled)."""
    advantages: torch.Tensor
    """A_t from an advantage estimator."""
    response_mask: torch.Tensor
    """1 where the token gets a loss; 0 for padding, prompt or tool tokens."""
    is_weights: torch.Tensor | None = None
    """Detached per-token importance weights multiplied into the loss (rollout/train mismatch
    correction); None: all ones."""
    behaviour_log_probs: torch.Tensor | None = None
    """log π_behav of the policy that generated the tokens (the rollout engine's), when it differs from
    the proximal policy of `old_log_probs` (asynchronous training; read by decoupled_ppo)."""


def _log_ratio(inputs: PolicyLossInputs, mask: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """log(π_θ / π_old), clamped, 0 off the mask. [B, T]."""
    log_ratio = zero_masked(inputs.log_probs - inputs.old_log_probs, mask)
    return log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def _finish(pg_losses, inputs, mask, agg, stats: Stats, log_ratio) -> tuple[torch.Tensor, Stats]:
    """Apply importance weights, aggregate, and add the stats every loss reports."""
    if inputs.is_weights is not None:
        pg_losses = pg_losses * zero_masked(inputs.is_weights.detach(), mask)
    loss = aggregate_loss(pg_losses, mask, agg)
    stats["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    stats["pg_loss"] = loss.detach()
    return loss, stats


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of response tokens where `flags` holds (0-dim, detached)."""
    return ((flags & mask).sum() / mask.sum().clamp(min=1)).detach().float()


@register_policy_loss("ppo_clip")
def ppo_clip(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation):
    """PPO clipped surrogate (Schulman et al. 2017), asymmetric clip-higher (DAPO), dual clip.

    r = π_θ / π_old,  pg_losses = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),
    and with dual clip, for A < 0: pg_losses = min(pg_losses, −A·c).
    Computed in the equivalent one-branch form −A·r', r' = min(r, 1+ε_high) where A ≥ 0 and
    clamp(r, 1−ε_low, c) where A < 0: identical values and gradients, half the elementwise passes.
    Stats: pg_clipfrac (the ε clip is active), pg_clipfrac_lower (the dual clip is), ppo_kl.
    """
    mask = inputs.response_mask.bool()
    log_ratio = _log_ratio(inputs, mask, cfg)
    advantages = zero_masked(inputs.advantages, mask)
    ratio = torch.exp(log_ratio)
    upper = ratio.clamp(max=1 + cfg.clip_ratio_high)  # A ≥ 0 branch
    lower = ratio.clamp(min=1 - cfg.clip_ratio_low, max=cfg.clip_ratio_c or math.inf)  # A < 0
    clipped_ratio = torch.where(advantages >= 0, upper, lower)
    pg_losses = -advantages * clipped_ratio
    with torch.no_grad():
        clipped = (clipped_ratio != ratio) & (advantages != 0)
        dual = (advantages < 0) & (ratio > (cfg.clip_ratio_c or math.inf))
        stats = {"pg_clipfrac": _fraction(clipped & ~dual, mask), "pg_clipfrac_lower": _fraction(dual, mask)}
    return _finish(pg_losses, inputs, mask, agg, stats, log_ratio)


@register_policy_loss("gspo")
def gspo(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation):
    """GSPO (Zheng et al. 2025), GSPO-token form: a sequence-level ratio with token gradients.

    s_i = exp((1/|y_i|) Σ_t log r_{i,t})  (geometric mean of the token ratios),
    s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)],
    pg_losses = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1−ε_low, 1+ε_high)).
    The paper uses tiny ε (3e-4 / 4e-4) and seq-mean-token-mean aggregation.
    """
    mask = inputs.response_mask.bool()
    log_ratio = _log_ratio(inputs, mask, cfg)
    log_probs = zero_masked(inputs.log_probs, mask)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    token_log_ratio = seq_log_ratio.detach()[:, None] + log_probs - log_probs.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=cfg.log_ratio_clamp))
    advantages = zero_masked(inputs.advantages, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    stats = {"pg_clipfrac": _fraction(pg_losses2 > pg_losses1, mask)}
    return _finish(pg_losses, inputs, mask, agg, stats, log_ratio)


@register_policy_loss("cispo")
def cispo(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    pg_losses = −sg[clip(r, 1 − ε_low, 1 + ε_high)] · A · log π_θ.  Unlike PPO no token loses its
    gradient; the weight is only capped. MiniMax drops the lower bound (ε_low ≥ 1).
    """
    mask = inputs.response_mask.bool()
    log_ratio = _log_ratio(inputs, mask, cfg)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(max(0.0, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
    pg_losses = -weight * zero_masked(inputs.advantages, mask) * zero_masked(inputs.log_probs, mask)
    stats = {"pg_clipfrac": _fraction(weight != ratio, mask)}
    return _finish(pg_losses, inputs, mask, agg, stats, log_ratio)


@register_policy_loss("decoupled_ppo")
def decoupled_ppo(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation):
    """Decoupled PPO (Hilton et al. 2022; AReaL's asynchronous objective): the behaviour policy that
    generated the tokens (π_behav: `behaviour_log_probs`, the engine's, possibly several versions old)
    is separated from the proximal policy the update is trusted around (π_prox: `old_log_probs`, the
    current weights recomputed before the update).

    pg_losses = w · max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),  r = π_θ / π_prox,
    w = sg[π_prox / π_behav] truncated at `behaviour_weight_cap` (or, mode mask, tokens above it
    dropped). With π_behav = π_prox (no staleness) w = 1 and this is ppo_clip exactly.
    Stats: ppo_clip's, plus behaviour_weight_mean, behaviour_clipfrac (tokens over the cap),
    behaviour_kl (k1 estimate of KL(π_behav ‖ π_prox) on the behaviour's own samples).
    """
    mask = inputs.response_mask.bool()
    behaviour = inputs.behaviour_log_probs
    if behaviour is None:
        raise ValueError("decoupled_ppo needs PolicyLossInputs.behaviour_log_probs (the rollout engine's log-probs)")
    log_weight = zero_masked(inputs.old_log_probs.detach() - behaviour.detach(), mask)
    over = (log_weight > math.log(cfg.behaviour_weight_cap)) & mask
    weight = torch.exp(log_weight.clamp(max=math.log(cfg.behaviour_weight_cap)))
    weight = torch.where(over, 0.0, weight) if cfg.behaviour_weight_mode == "mask" else weight
    combined = weight if inputs.is_weights is None else weight * inputs.is_weights.detach()
    loss, stats = ppo_clip(dataclasses.replace(inputs, is_weights=combined), cfg, agg)
    stats.update(
        {
            "behaviour_weight_mean": masked_mean(zero_masked(weight, mask), mask),
            "behaviour_clipfrac": _fraction(over, mask),
            "behaviour_kl": masked_mean(-log_weight, mask),
        }
    )
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dim. logits [..., V] → [...]."""
    log_z = torch.logsumexp(logits, dim=-1)
    return log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_bonus(
    entropy: torch.Tensor, response_mask: torch.Tensor, agg: LossAggregation, coef: float
) -> tuple[torch.Tensor, Stats]:
    """Entropy bonus as a loss term: −coef · aggregate(H). entropy, response_mask: [B, T]."""
    mask = response_mask.bool()
    loss = -coef * aggregate_loss(entropy, mask, agg)
    return loss, {"entropy": masked_mean(entropy.detach(), mask)}
