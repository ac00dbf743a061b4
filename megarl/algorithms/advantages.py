"""Advantage estimators, registered by name in `ADVANTAGE_ESTIMATORS`.

Every estimator has the same signature

    fn(inputs: AdvantageInputs, cfg: AdvantageConfig) -> (advantages [B, T], returns [B, T])

so the trainer calls `get_advantage_estimator(cfg.estimator)(inputs, cfg)` and never special-cases
one. Each estimator declares what it reads beyond the rewards and the mask
(`@register_advantage_estimator("gae", needs=("values",))`; `estimator_needs(name)`): critic
`values`, prompt `group_ids`, or the greedy `baseline_rewards`. Config validation checks those needs
against the run (a critic exists, groups have more than one sample) before anything starts, and the
trainer produces what is declared (e.g. the greedy baseline generation for ReMax). A user estimator
loaded by dotted path declares its needs as a `needs` attribute of the function. Masked-out tokens (padding, tool output) are not steps of the policy: they carry no reward,
value or discount, their values are never read (NaN there is harmless), and both outputs are 0 there.
Groups (samples of one prompt) are given by a per-row id and need not be contiguous.

Imports only torch and numpy (no megatron, vLLM or Ray).
"""

import math
from dataclasses import dataclass

import torch

from megarl.algorithms.masked import (
    GroupIds,
    group_codes,
    group_mean_std,
    masked_whiten,
    whiten_zeroed,
    zero_masked,
)
from megarl.utils.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator", ("inputs", "cfg"))
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
ESTIMATOR_NEEDS = ("values", "group_ids", "baseline_rewards")
"""What an estimator may need beyond rewards and mask: the optional fields of `AdvantageInputs`."""


def register_advantage_estimator(*names: str, needs: tuple[str, ...] = ()):
    """Decorator: register an estimator under `names`, declaring the optional inputs it reads."""
    unknown = [n for n in needs if n not in ESTIMATOR_NEEDS]
    if unknown:
        raise ValueError(f"advantage estimator needs {unknown} are unknown; declare some of {ESTIMATOR_NEEDS}")

    def add(fn):
        fn.needs = tuple(needs)
        return ADVANTAGE_ESTIMATORS.register(*names)(fn)

    return add


def estimator_needs(name: str) -> tuple[str, ...]:
    """The optional `AdvantageInputs` fields estimator `name` reads (its declared `needs`)."""
    return tuple(getattr(get_advantage_estimator(name), "needs", ()))


@dataclass
class AdvantageConfig:
    """Knobs of the advantage estimators (each estimator reads the ones it needs)."""

    estimator: str = "grpo"
    """Name in ADVANTAGE_ESTIMATORS: gae, grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline), remax."""
    gamma: float = 1.0
    """Discount γ per response token (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE λ: 1 is Monte-Carlo return minus value, 0 is one-step TD."""
    whiten_gae: bool = True
    """Whiten GAE advantages over all response tokens of the batch."""
    grpo_std_norm: bool = True
    """Divide GRPO advantages by the group's reward std (dr_grpo ignores this and never does)."""
    eps: float = 1e-6
    """Added to the group std before dividing."""

    def __post_init__(self):
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must lie in [0, 1]; got gamma={self.gamma}, lam={self.lam}")


@dataclass
class AdvantageInputs:
    """What an estimator may read; all [B, T] tensors are aligned with the response tokens."""

    token_level_rewards: torch.Tensor
    """[B, T] reward per response token (outcome rewards sit on the last token)."""
    response_mask: torch.Tensor
    """[B, T] 1 where the token is a policy action that gets a loss, 0 for padding/tool tokens."""
    values: torch.Tensor | None = None
    """[B, T] critic values V(s_t) (gae)."""
    group_ids: GroupIds | None = None
    """[B] id of each row's prompt group, ints or strings in any order (grpo, rloo, ..._baseline)."""
    baseline_rewards: torch.Tensor | None = None
    """[B] reward of the greedy response to the same prompt (remax)."""

    def require(self, field: str, estimator: str):
        """The field's value, or a ValueError naming the estimator that needs it."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
        return value


# ---------------------------------------------------------------------------------------------
# Reverse discounted scan: y_t = x_t + c_t · y_{t+1}
# ---------------------------------------------------------------------------------------------


def discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, discount: float, chunk: int | None = None):
    """Reverse discounted sum over response tokens, skipping masked ones. x, mask: [B, T] → [B, T].

    y_t = x_t + discount · y_{t+1} on masked-in tokens; a masked-out token passes y_{t+1} through
    (it is not a step); the output is 0 there. Vectorised over B and T: in reversed time the
    recurrence is h_j = c_j h_{j−1} + u_j, whose closed form within a chunk of L tokens is
        h_j = P_j · (h_{start−1} + Σ_{s≤j} u_s / P_s),   P_j = Π_{start≤k≤j} c_k  (cumprod),
    so only the ⌈T/L⌉ chunk boundaries are sequential. L keeps P ≥ 1e-20 (no underflow or
    overflow), and the rounding error is of the same order as the step-by-step loop's.
    """
    mask = mask.bool()
    return _discounted_cumsum(zero_masked(x, mask), mask.to(x.dtype), discount, chunk)


def _discounted_cumsum(x, weight, discount, chunk=None):
    """`discounted_cumsum` of x that is already 0 off the mask; weight is the mask in x's dtype."""
    if discount == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1).mul_(weight)
    if discount == 0.0:
        return x
    u = x.flip(-1)
    decay = weight.flip(-1).mul_(discount - 1.0).add_(1.0)  # c = discount on tokens, 1 off
    length = chunk or max(1, int(math.log(1e-20) / math.log(discount)))
    h = torch.empty_like(u)
    carry = u.new_zeros(u.shape[0], 1)
    for start in range(0, u.shape[-1], length):
        window = slice(start, start + length)
        carry = _scan_chunk(u[:, window], decay[:, window], carry, h[:, window])
    return h.flip(-1).mul_(weight)


def _scan_chunk(u, decay, carry, out):
    """h_j = decay_j · h_{j−1} + u_j over one chunk, written into `out`; returns the last h [B, 1]."""
    prod = decay.cumprod(-1)  # P_j
    torch.div(u, prod, out=out).cumsum_(-1)  # Σ_{s≤j} u_s / P_s
    out.add_(carry).mul_(prod)
    return out[:, -1:]


def next_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """V at the next masked-in token after t, 0 after the last one. values, mask: [B, T] → [B, T].

    `values` must already be 0 on masked-out tokens.
    """
    if bool((mask[:, 1:] <= mask[:, :-1]).all()):  # no holes: next token or none
        return torch.nn.functional.pad(values[:, 1:], (0, 1))
    B, T = values.shape
    positions = torch.arange(T, device=values.device).expand(B, T)
    valid_pos = torch.where(mask, positions, T)  # T = "none"
    next_pos = valid_pos.flip(-1).cummin(-1).values.flip(-1)  # first valid s ≥ t
    next_pos = torch.nn.functional.pad(next_pos[:, 1:], (0, 1), value=T)  # s > t
    return torch.nn.functional.pad(values, (0, 1)).gather(-1, next_pos)


def sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """Per-row score [B]: the sum of token-level rewards over response tokens."""
    rewards = inputs.token_level_rewards
    return zero_masked(rewards, inputs.response_mask).sum(-1).to(_float_dtype(rewards))


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _masked_rewards(inputs: AdvantageInputs, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards as floats (≥ float32), 0 off the mask. [B, T]."""
    rewards = inputs.token_level_rewards
    return zero_masked(rewards, mask).to(_float_dtype(rewards))


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row scalars [B] → [B, T] on response tokens, 0 elsewhere."""
    return zero_masked(per_row[:, None].expand(mask.shape), mask)


# ---------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------


@register_advantage_estimator("gae", needs=("values",))
def gae(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """Generalised advantage estimation (Schulman et al. 2016).

    δ_t = r_t + γ V_{t+1} − V_t,   A_t = Σ_l (γλ)^l δ_{t+l},   returns R_t = A_t + V_t,
    with t running over response tokens only. A is whitened over the batch if cfg.whiten_gae.
    """
    mask = inputs.response_mask.bool()
    rewards = _masked_rewards(inputs, mask)
    values = zero_masked(inputs.require("values", "gae"), mask)
    values = values.to(torch.promote_types(values.dtype, rewards.dtype))
    rewards = rewards.to(values.dtype)
    weight = mask.to(values.dtype)
    # δ_t = r_t + γ V_{t+1} − V_t on response tokens (in place: no temporaries at [B, T])
    deltas = next_values(values, mask).mul_(cfg.gamma).add_(rewards).sub_(values).mul_(weight)
    advantages = _discounted_cumsum(deltas, weight, cfg.gamma * cfg.lam)
    returns = advantages + values  # both 0 off the mask
    if cfg.whiten_gae:
        advantages = whiten_zeroed(advantages, weight)
    return advantages, returns


def _grpo(inputs: AdvantageInputs, cfg: AdvantageConfig, std_norm: bool, name: str):
    scores = sequence_scores(inputs)
    codes, num_groups = group_codes(inputs.require("group_ids", name), scores.device)
    mean, std, size = group_mean_std(scores, codes, num_groups)
    advantages = scores - mean
    if std_norm:
        advantages = advantages / (std + cfg.eps)
    advantages = _broadcast(torch.where(size > 1, advantages, 0.0), inputs.response_mask)
    return advantages, advantages


@register_advantage_estimator("grpo", needs=("group_ids",))
def grpo(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """GRPO (Shao et al. 2024): A_i = (s_i − mean_group(s)) / (std_group(s) + eps) on every token.

    std is Bessel-corrected; without cfg.grpo_std_norm it is Dr. GRPO. A group of one has no
    baseline to compare with, so its advantage is 0 (verl passes the raw score through instead).
    """
    return _grpo(inputs, cfg, cfg.grpo_std_norm, "grpo")


@register_advantage_estimator("dr_grpo", needs=("group_ids",))
def dr_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """Dr. GRPO (Liu et al. 2025): A_i = s_i − mean_group(s), no std normalisation."""
    return _grpo(inputs, cfg, False, "dr_grpo")


@register_advantage_estimator("rloo", needs=("group_ids",))
def rloo(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """RLOO (Ahmadian et al. 2024): A_i = s_i − mean_{j≠i in group}(s_j) = n/(n−1)·(s_i − mean).

    A group of one has no leave-one-out baseline: advantage 0.
    """
    scores = sequence_scores(inputs)
    codes, num_groups = group_codes(inputs.require("group_ids", "rloo"), scores.device)
    mean, _, size = group_mean_std(scores, codes, num_groups)
    advantages = (scores - mean) * size / (size - 1).clamp(min=1)
    advantages = _broadcast(torch.where(size > 1, advantages, 0.0), inputs.response_mask)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """REINFORCE++ (Hu 2025): G_t = Σ_{s≥t} γ^{s−t} r_s over response tokens, whitened over the batch.

    Returns are G (before whitening).
    """
    mask = inputs.response_mask.bool()
    rewards = _masked_rewards(inputs, mask)
    returns = discounted_cumsum(rewards, mask, cfg.gamma)
    return masked_whiten(returns, mask), returns


@register_advantage_estimator("reinforce_plus_plus_baseline", needs=("group_ids",))
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """REINFORCE++-baseline: A_i = s_i − mean_group(s) on every token, then whitened over the batch."""
    scores = sequence_scores(inputs)
    group_ids = inputs.require("group_ids", "reinforce_plus_plus_baseline")
    codes, num_groups = group_codes(group_ids, scores.device)
    mean, _, _ = group_mean_std(scores, codes, num_groups)
    centered = _broadcast(scores - mean, inputs.response_mask)
    return masked_whiten(centered, inputs.response_mask), centered


@register_advantage_estimator("remax", needs=("baseline_rewards",))
def remax(inputs: AdvantageInputs, cfg: AdvantageConfig):
    """ReMax (Li et al. 2024): A_t = Σ_{s≥t} r_s − b, b the greedy response's reward.

    Returns are the undiscounted reward-to-go Σ_{s≥t} r_s.
    """
    mask = inputs.response_mask.bool()
    baseline = inputs.require("baseline_rewards", "remax")
    rewards = _masked_rewards(inputs, mask)
    returns = discounted_cumsum(rewards, mask, 1.0)
    advantages = zero_masked(returns - baseline.to(returns.dtype)[:, None], mask)
    return advantages, returns
