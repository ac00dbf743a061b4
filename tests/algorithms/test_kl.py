"""KL estimators, KL penalty in the reward, KL loss, and the KL controllers."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megarl.algorithms.aggregation import LossAggregation
from megarl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    make_kl_controller,
)

LOG2 = math.log(2)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("k1", LOG2),
        ("kl", LOG2),
        ("k2", 0.5 * LOG2**2),
        ("mse", 0.5 * LOG2**2),
        ("k3", 0.5 + LOG2 - 1),
        ("low_var_kl", 0.5 + LOG2 - 1),
        ("abs", LOG2),
    ],
)
def test_kl_estimators_hand_computed_policy_twice_reference(name, expected):
    # π = .5, π_ref = .25: log r = log 2; k3 = π_ref/π − log(π_ref/π) − 1 = .5 + log 2 − 1
    kl = get_kl_estimator(name)(t([math.log(0.5)]), t([math.log(0.25)]))
    assert kl.item() == pytest.approx(expected)


def test_k3_is_clamped_to_ten():
    assert get_kl_estimator("k3")(t([0.0]), t([-30.0])).item() == 10.0


@settings(max_examples=50, deadline=None)
@given(st.floats(-15, 0), st.floats(-15, 0))
@example(-1.6317452910178997e-09, 0.0)  # exp(r) - r - 1 rounded to -1.1e-16 here
def test_k2_k3_abs_are_non_negative_and_zero_when_equal(log_p, log_ref):
    for name in ["k2", "k3", "abs"]:
        fn = get_kl_estimator(name)
        assert fn(t([log_p]), t([log_ref])).item() >= 0
        assert fn(t([log_p]), t([log_p])).item() == 0


def test_k3_is_an_unbiased_estimate_of_kl_under_sampling():
    probs, ref = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    exact = (probs * (probs / ref).log()).sum()
    k3 = get_kl_estimator("k3")(probs.log(), ref.log())
    torch.testing.assert_close((probs * k3).sum(), exact)  # expectation over a ~ π


def test_apply_kl_penalty_subtracts_beta_kl_on_response_tokens():
    scores = t([[0, 0, 1], [0, 2, 0]])
    log_probs = t([[0.1, 0.2, 0.3], [0.4, 0.4, math.nan]])
    rewards, stats = apply_kl_penalty(
        scores, log_probs, torch.zeros_like(log_probs), t([[1, 1, 1], [1, 1, 0]]), kl_coef=0.5, estimator="k1"
    )
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 0.85], [-0.2, 1.8, 0.0]]))
    assert stats["kl"].item() == pytest.approx((0.2 + 0.4) / 2)  # mean over rows of per-row mean KL


def test_kl_loss_is_beta_times_aggregated_kl_and_has_gradient():
    log_probs = t([[math.log(0.5), 0.0]]).requires_grad_(True)
    loss, stats = kl_loss(
        log_probs, t([[math.log(0.25), 5.0]]), t([[1, 0]]), LossAggregation(), kl_coef=0.1, estimator="k3"
    )
    assert loss.item() == pytest.approx(0.1 * (0.5 + LOG2 - 1))
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert grad[0, 0].item() == pytest.approx(0.1 * (1 - 0.5)) and grad[0, 1] == 0  # d/dlogπ k3 = 1 − π_ref/π


def test_adaptive_controller_follows_ziegler_update_with_clipped_error():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error clipped to +.2: β·(1 + .2·.1)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=6.6, n_steps=1000)  # error .1
    assert ctl.value == pytest.approx(0.102 * 1.01)
    ctl.update(current_kl=0.0, n_steps=10000)  # error clipped to −.2
    assert ctl.value == pytest.approx(0.102 * 1.01 * 0.8)


def test_fixed_controller_never_moves_and_config_picks_the_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 10**6)
    assert ctl.value == 0.05
    assert isinstance(make_kl_controller(KLConfig(coef=0.1)), FixedKLController)
    adaptive = make_kl_controller(KLConfig(coef=0.1, target_kl=3.0, horizon=100))
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1
    with pytest.raises(ValueError, match="target_kl and horizon"):
        AdaptiveKLController(0.1, 0.0, 10)
