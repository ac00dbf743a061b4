"""KL estimators (registered in `KL_ESTIMATORS`), KL as a reward penalty or as a loss term, and
the fixed / adaptive KL coefficient controllers.

Estimators take per-token log-probs of the policy and the reference, both [B, T], and return a
per-token estimate of KL(π_θ ‖ π_ref) for tokens sampled from π_θ (Schulman, "Approximating KL
divergence", 2020):

    k1   log r                  (r = π_θ / π_ref; unbiased, high variance, can be negative)
    k2   ½ (log r)²
    k3   (1/r) − 1 + log r      ("low_var_kl"; unbiased, ≥ 0; clamped to [−10, 10] as in verl)
    abs  |log r|

Imports only torch (no megatron, vLLM or Ray).
"""

from dataclasses import dataclass

import torch

from megarl.algorithms.aggregation import LossAggregation, aggregate_loss
from megarl.algorithms.masked import masked_mean, zero_masked
from megarl.utils.registry import Registry

KL_ESTIMATORS = Registry("KL estimator", ("log_probs", "ref_log_probs"))
register_kl_estimator = KL_ESTIMATORS.register
get_kl_estimator = KL_ESTIMATORS.get


@register_kl_estimator("k1", "kl")
def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """log π_θ − log π_ref."""
    return log_probs - ref_log_probs


@register_kl_estimator("k2", "mse")
def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """½ (log π_θ − log π_ref)²."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3", "low_var_kl")
def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1, clamped to [−10, 10].

    Computed as expm1(r) − r: exp(r) − r − 1 cancels to a rounding error for |r| near 0 and came out
    slightly negative (−1.1e-16 at r = −1.6e-9); expm1(r) ≥ r holds after rounding too."""
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.expm1(log_ratio) - log_ratio).clamp(-10.0, 10.0)


@register_kl_estimator("abs")
def abs_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log π_θ − log π_ref|."""
    return (log_probs - ref_log_probs).abs()


@dataclass
class KLConfig:
    """KL regularisation towards the reference policy."""

    estimator: str = "k3"
    """Name in KL_ESTIMATORS: k1 (kl), k2 (mse), k3 (low_var_kl), abs."""
    coef: float = 0.0
    """β; 0 turns the KL term off. With target_kl set, the adaptive controller's initial β."""
    target_kl: float | None = None
    """Adaptive controller target (Ziegler et al. 2019); None: fixed β."""
    horizon: int = 10000
    """Adaptive controller horizon, in samples."""


def masked_kl(log_probs, ref_log_probs, response_mask, estimator: str) -> torch.Tensor:
    """Per-token KL estimate [B, T], 0 off the mask (padding is sanitised first)."""
    mask = response_mask.bool()
    kl = get_kl_estimator(estimator)(zero_masked(log_probs, mask), zero_masked(ref_log_probs, mask))
    return zero_masked(kl, mask)


def apply_kl_penalty(
    token_level_scores, log_probs, ref_log_probs, response_mask, kl_coef: float, estimator: str = "k1"
):
    """KL in the reward: token_level_rewards = scores − β·kl on response tokens. All [B, T].

    Returns (token_level_rewards, stats); stats["kl"] is the batch mean of each sequence's mean
    token KL — feed it to the controller's `update`.
    """
    mask = response_mask.bool()
    kl = masked_kl(log_probs, ref_log_probs, mask, estimator).detach()
    rewards = zero_masked(token_level_scores, mask) - kl_coef * kl
    seq_kl = masked_mean(kl, mask, dim=-1)
    stats = {"kl": seq_kl.mean(), "kl_coef": torch.tensor(float(kl_coef))}
    return rewards, stats


def kl_loss(log_probs, ref_log_probs, response_mask, agg: LossAggregation, kl_coef: float, estimator: str = "k3"):
    """KL as a loss term: β · aggregate(kl) (the GRPO way). Returns (loss, stats)."""
    mask = response_mask.bool()
    kl = masked_kl(log_probs, ref_log_probs, mask, estimator)
    loss = kl_coef * aggregate_loss(kl, mask, agg)
    stats = {"kl_loss": masked_mean(kl.detach(), mask), "kl_coef": torch.tensor(float(kl_coef))}
    return loss, stats


class FixedKLController:
    """Constant β."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: β stays fixed."""


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019): β ← β · (1 + clip(KL/target − 1, −0.2, 0.2) · n / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0; got {target_kl}, {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β towards the target after a batch of `n_steps` samples with mean KL `current_kl`."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def make_kl_controller(cfg: KLConfig) -> FixedKLController | AdaptiveKLController:
    """The controller `cfg` describes: adaptive when cfg.target_kl is set, else fixed."""
    if cfg.target_kl is None:
        return FixedKLController(cfg.coef)
    return AdaptiveKLController(cfg.coef, cfg.target_kl, cfg.horizon)
