"""Policy losses, value loss and entropy: hand-computed values and gradients, and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms.aggregation import LossAggregation
from megarl.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossInputs,
    entropy_bonus,
    entropy_from_logits,
    get_policy_loss,
)
from megarl.algorithms.value_loss import ValueLossConfig, ValueLossInputs, value_loss

FAST = settings(max_examples=50, deadline=None)
LOSSES = ["ppo_clip", "gspo", "cispo"]
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOKEN_MEAN = LossAggregation("token-mean")


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def policy_loss(name, ratios, advantages, mask=None, cfg=None, log_probs=None, agg=TOKEN_MEAN):
    """(loss, stats, d loss / d log_probs) with old log-probs chosen so π/π_old = ratios."""
    ratios, advantages = t(ratios), t(advantages)
    log_probs = (t(log_probs) if log_probs is not None else torch.zeros_like(ratios)).requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else t(mask)
    inputs = PolicyLossInputs(log_probs, log_probs.detach() - ratios.log(), advantages, mask)
    loss, stats = get_policy_loss(name)(inputs, cfg or PolicyLossConfig(), agg)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, stats, grad


def reference_ppo(log_probs, old_log_probs, advantages, mask, low, high, clip_c):
    """verl's compute_policy_loss, unfused, token-mean."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-20, 20))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses = clip_pg_losses1
    if clip_c is not None:
        clip_pg_losses2 = torch.min(-advantages * clip_c, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return (pg_losses * mask).sum() / mask.sum()


def random_inputs(seed, B, T, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    log_probs = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    old_log_probs = log_probs + 0.4 * torch.randn(B, T, generator=gen, dtype=dtype)
    advantages = torch.randn(B, T, generator=gen, dtype=dtype)
    return log_probs, old_log_probs, advantages, mask


# ---- ppo_clip ----------------------------------------------------------------------------------


def test_ppo_clip_asymmetric_hand_computed_loss_grad_and_stats():
    # r = [1.5, .5, 1.1, .5], A = [1, 1, −1, −1], clip to [.8, 1.28]:
    # losses [−1.28 (clipped), −.5, 1.1, .8 (clipped)]; grad −A·r/4 where unclipped
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, stats, grad = policy_loss("ppo_clip", [[1.5, 0.5, 1.1, 0.5]], [[1, 1, -1, -1]], cfg=cfg)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8) / 4)
    torch.testing.assert_close(grad, t([[0.0, -0.125, 0.275, 0.0]]))
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)
    assert stats["pg_clipfrac_lower"].item() == 0
    assert stats["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + 2 * math.log(0.5) + math.log(1.1)) / 4)


def test_ppo_dual_clip_caps_negative_advantage_loss_at_c():
    # A = −1: r = 5 → min(max(5, 1.2), 3) = 3 (dual clip, no grad); r = 2 → 2
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    loss, stats, grad = policy_loss("ppo_clip", [[5.0, 2.0]], [[-1, -1]], cfg=cfg)
    assert loss.item() == pytest.approx((3 + 2) / 2)
    torch.testing.assert_close(grad, t([[0.0, 1.0]]))
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(0.5)
    assert stats["pg_clipfrac"].item() == 0


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=0.9)


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(1, 5),
    T=st.integers(1, 20),
    high=st.sampled_from([0.2, 0.28]),
    clip_c=st.sampled_from([None, 3.0]),
)
def test_ppo_clip_matches_unfused_reference_values_and_grads(seed, B, T, high, clip_c):
    log_probs, old, adv, mask = random_inputs(seed, B, T)
    log_probs.requires_grad_(True)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=high, clip_ratio_c=clip_c)
    ours, _ = get_policy_loss("ppo_clip")(PolicyLossInputs(log_probs, old, adv, mask), cfg, TOKEN_MEAN)
    ref = reference_ppo(log_probs, old, adv, mask.double(), 0.2, high, clip_c)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, log_probs)[0], torch.autograd.grad(ref, log_probs)[0])


# ---- gspo / cispo ------------------------------------------------------------------------------


def test_gspo_hand_computed_sequence_ratio_and_clip():
    # log r = [.2, −.4] in both rows → s = exp(−.1) ≈ .905; ε = .05 → clip(s) = .95
    # row 0 (A = 1): max(−s, −.95) = −s, unclipped;  row 1 (A = −1): max(s, .95) = .95, clipped
    cfg = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05)
    ratios = [[math.exp(0.2), math.exp(-0.4)]] * 2
    loss, stats, grad = policy_loss("gspo", ratios, [[1, 1], [-1, -1]], cfg=cfg)
    s = math.exp(-0.1)
    assert loss.item() == pytest.approx((-2 * s + 2 * 0.95) / 4)
    torch.testing.assert_close(grad, t([[-s / 4, -s / 4], [0.0, 0.0]]))
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)


@FAST
@given(seed=st.integers(0, 2**31), B=st.integers(1, 5), T=st.integers(1, 10))
def test_gspo_equals_ppo_when_every_token_of_a_row_has_the_same_ratio(seed, B, T):
    log_probs, _, adv, mask = random_inputs(seed, B, T)
    row_log_ratio = 0.3 * torch.randn(B, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    old = log_probs - row_log_ratio
    adv = adv[:, :1].expand(B, T)  # GSPO advantages are per sequence
    results = []
    for name in ["gspo", "ppo_clip"]:
        lp = log_probs.clone().requires_grad_(True)
        loss, _ = get_policy_loss(name)(PolicyLossInputs(lp, old, adv, mask), PolicyLossConfig(), TOKEN_MEAN)
        results.append((loss, torch.autograd.grad(loss, lp)[0]))
    torch.testing.assert_close(results[0], results[1])


def test_cispo_hand_computed_clipped_weight_times_log_prob():
    # r = [2, .5], A = [1, −2], log π = [−1, −2], weight = clip(r, ., 1.28) = [1.28, .5]
    # losses −w·A·logπ = [1.28, −2];  grad −w·A / 2 = [−.64, .5]
    cfg = PolicyLossConfig(clip_ratio_low=1.0, clip_ratio_high=0.28)
    loss, stats, grad = policy_loss("cispo", [[2.0, 0.5]], [[1, -2]], cfg=cfg, log_probs=[[-1.0, -2.0]])
    assert loss.item() == pytest.approx((1.28 - 2) / 2)
    torch.testing.assert_close(grad, t([[-0.64, 0.5]]))
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)


def test_cispo_keeps_gradient_on_tokens_ppo_would_clip():
    _, _, grad = policy_loss("cispo", [[3.0]], [[1.0]], log_probs=[[-1.0]])
    assert grad.item() == pytest.approx(-1.2)  # weight capped at 1.2, gradient not zeroed


# ---- properties shared by every policy loss ----------------------------------------------------


def garbage_pad(x, mask, extra, seed):
    """x [B, T] → [B, T + extra] with NaN/inf/huge values wherever `mask` (padded) is 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.pad(x, (0, extra))
    garbage = torch.randn(x.shape, generator=gen, dtype=x.dtype) * 1e4
    garbage.view(-1)[::4] = math.nan
    garbage.view(-1)[1::7] = -math.inf
    return torch.where(mask, x, garbage)


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    extra=st.integers(0, 5),
    name=st.sampled_from(LOSSES),
    mode=st.sampled_from(MODES),
)
def test_padding_with_garbage_changes_neither_loss_nor_grad(seed, B, T, extra, name, mode):
    log_probs, old, adv, mask = random_inputs(seed, B, T)
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    agg = LossAggregation(mode, max_response_len=T + 5)
    lp = log_probs.clone().requires_grad_(True)
    loss, _ = get_policy_loss(name)(PolicyLossInputs(lp, old, adv, mask, is_weights=torch.ones_like(adv)), cfg, agg)
    (grad,) = torch.autograd.grad(loss, lp)

    mask_p = torch.nn.functional.pad(mask, (0, extra))
    lp_p = garbage_pad(log_probs, mask_p, extra, seed).requires_grad_(True)
    padded = PolicyLossInputs(
        lp_p,
        garbage_pad(old, mask_p, extra, seed + 1),
        garbage_pad(adv, mask_p, extra, seed + 2),
        mask_p,
        is_weights=garbage_pad(torch.ones_like(adv), mask_p, extra, seed + 3),
    )
    loss_p, stats = get_policy_loss(name)(padded, cfg, agg)
    (grad_p,) = torch.autograd.grad(loss_p, lp_p)
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(grad_p[:, :T], grad)
    assert torch.all(grad_p[~mask_p] == 0)
    assert all(torch.isfinite(v) for v in stats.values())


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(2, 8),
    T=st.integers(1, 8),
    cut=st.integers(1, 7),
    name=st.sampled_from(LOSSES),
    mode=st.sampled_from(MODES),
)
def test_micro_batch_losses_and_grads_sum_to_full_batch(seed, B, T, cut, name, mode):
    log_probs, old, adv, mask = random_inputs(seed, B, T)
    agg = LossAggregation.for_batch(mode, mask, max_response_len=T)
    fn, cfg = get_policy_loss(name), PolicyLossConfig()
    lp = log_probs.clone().requires_grad_(True)
    full, _ = fn(PolicyLossInputs(lp, old, adv, mask), cfg, agg)
    (full_grad,) = torch.autograd.grad(full, lp)
    cut = min(cut, B - 1)
    parts = [fn(PolicyLossInputs(lp[s], old[s], adv[s], mask[s]), cfg, agg)[0] for s in (slice(0, cut), slice(cut, B))]
    (part_grad,) = torch.autograd.grad(sum(parts), lp)
    assert abs(sum(parts).item() - full.item()) <= 1e-6
    torch.testing.assert_close(part_grad, full_grad, atol=1e-6, rtol=0)


def test_is_weights_scale_the_per_token_loss():
    log_probs, old, adv, mask = random_inputs(0, 2, 4)
    plain, _ = get_policy_loss("ppo_clip")(PolicyLossInputs(log_probs, old, adv, mask), PolicyLossConfig(), TOKEN_MEAN)
    halved, _ = get_policy_loss("ppo_clip")(
        PolicyLossInputs(log_probs, old, adv, mask, is_weights=torch.full_like(adv, 0.5)),
        PolicyLossConfig(),
        TOKEN_MEAN,
    )
    torch.testing.assert_close(halved, plain / 2)


# ---- value loss and entropy --------------------------------------------------------------------


def test_value_loss_clipped_hand_computed():
    # t0: (1 − 2)² = 1 vs clipped V = .5 + .2 = .7 → 1.69 (clipped branch, no grad)
    # t1: (2.4 − 0)² = 5.76 both ways (inside the clip) → grad ½·2·2.4/2 = 1.2
    values = t([[1.0, 2.4]]).requires_grad_(True)
    inputs = ValueLossInputs(values, t([[0.5, 2.5]]), t([[2.0, 0.0]]), t([[1, 1]]))
    loss, stats = value_loss(inputs, ValueLossConfig(value_clip=0.2), TOKEN_MEAN)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 5.76) / 2)
    torch.testing.assert_close(torch.autograd.grad(loss, values)[0], t([[0.0, 1.2]]))
    assert stats["vf_clipfrac"].item() == pytest.approx(0.5)


def test_value_loss_without_clip_is_half_squared_error():
    values = t([[1.0, 2.0]])
    loss, _ = value_loss(
        ValueLossInputs(values, values * 0, t([[0.0, 0.0]]), t([[1, 1]])), ValueLossConfig(value_clip=None), TOKEN_MEAN
    )
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)


def test_value_loss_ignores_garbage_padding():
    mask = t([[1, 0]])
    clean = value_loss(
        ValueLossInputs(t([[1.0, 0]]), t([[0.9, 0]]), t([[2.0, 0]]), mask), ValueLossConfig(), TOKEN_MEAN
    )
    dirty = value_loss(
        ValueLossInputs(t([[1.0, math.nan]]), t([[0.9, math.inf]]), t([[2.0, -1e9]]), mask),
        ValueLossConfig(),
        TOKEN_MEAN,
    )
    torch.testing.assert_close(dirty[0], clean[0])


def test_entropy_from_logits_matches_categorical():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))


def test_entropy_bonus_is_negative_coef_times_aggregated_entropy():
    loss, stats = entropy_bonus(t([[1.0, 3.0, 100.0]]), t([[1, 1, 0]]), TOKEN_MEAN, coef=0.01)
    assert loss.item() == pytest.approx(-0.01 * 2.0)
    assert stats["entropy"].item() == pytest.approx(2.0)


# ---- decoupled PPO (asynchronous training) -------------------------------------------------------


def _decoupled(ratios, advantages, behaviour_shift, cfg=None, mask=None):
    """Loss and grad with π/π_prox = ratios and log π_prox − log π_behav = behaviour_shift."""
    ratios, advantages, shift = t(ratios), t(advantages), t(behaviour_shift)
    log_probs = torch.zeros_like(ratios).requires_grad_(True)
    old = log_probs.detach() - ratios.log()
    mask = torch.ones_like(ratios) if mask is None else t(mask)
    inputs = PolicyLossInputs(log_probs, old, advantages, mask, behaviour_log_probs=old - shift)
    loss, stats = get_policy_loss("decoupled_ppo")(inputs, cfg or PolicyLossConfig(), TOKEN_MEAN)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, stats, grad


@FAST
@given(seed=st.integers(0, 2**31), B=st.integers(1, 4), T=st.integers(1, 6))
def test_decoupled_ppo_without_staleness_is_ppo_clip_in_value_and_grad(seed, B, T):
    gen = torch.Generator().manual_seed(seed)
    ratios = torch.exp(torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3).tolist()
    advantages = torch.randn(B, T, generator=gen, dtype=torch.float64).tolist()
    mask = (torch.rand(B, T, generator=gen) > 0.2).double().tolist()
    loss, stats, grad = _decoupled(ratios, advantages, [[0.0] * T] * B, mask=mask)
    ref_loss, ref_stats, ref_grad = policy_loss("ppo_clip", ratios, advantages, mask=mask)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert float(stats["behaviour_clipfrac"]) == 0.0 and float(stats["behaviour_kl"]) == 0.0


def test_decoupled_ppo_weights_each_token_by_the_truncated_proximal_behaviour_ratio():
    # r = π/π_prox = 1 (no clip); w = π_prox/π_behav = e^0.5, e^-1, and e^3 capped at 5
    loss, stats, grad = _decoupled([[1.0, 1.0, 1.0]], [[1.0, -2.0, 1.0]], [[0.5, -1.0, 3.0]])
    w = [math.exp(0.5), math.exp(-1.0), 5.0]
    expected = (-1.0 * w[0] + 2.0 * w[1] - 1.0 * w[2]) / 3
    assert float(loss.detach()) == pytest.approx(expected)
    assert grad[0].tolist() == pytest.approx([-w[0] / 3, 2.0 * w[1] / 3, -w[2] / 3])  # d(−A·w·r)/dlogπ = −A·w·r
    assert float(stats["behaviour_clipfrac"]) == pytest.approx(1 / 3)
    masked, stats, _ = _decoupled(
        [[1.0, 1.0, 1.0]], [[1.0, -2.0, 1.0]], [[0.5, -1.0, 3.0]], cfg=PolicyLossConfig(behaviour_weight_mode="mask")
    )
    assert float(masked.detach()) == pytest.approx((-1.0 * w[0] + 2.0 * w[1]) / 3)  # the over-cap token dropped


def test_decoupled_ppo_needs_the_behaviour_log_probs():
    inputs = PolicyLossInputs(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]))
    with pytest.raises(ValueError, match="decoupled_ppo needs PolicyLossInputs.behaviour_log_probs"):
        get_policy_loss("decoupled_ppo")(inputs, PolicyLossConfig(), TOKEN_MEAN)
