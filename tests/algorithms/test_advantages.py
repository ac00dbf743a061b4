"""Advantage estimators: hand-computed cases, and properties (padding, permutation, group means)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    discounted_cumsum,
    get_advantage_estimator,
)

FAST = settings(max_examples=50, deadline=None)
ESTIMATORS = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
GROUPED = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def run(name, cfg=None, **fields):
    return get_advantage_estimator(name)(AdvantageInputs(**fields), cfg or AdvantageConfig())


def random_inputs(seed, B, T, holes=True, group_size=3):
    """Right-padded responses (optionally with masked tool-token holes), rewards, values, groups."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=gen) > 0.2
        mask[torch.arange(B), 0] = True
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    group_ids = np.array([f"prompt-{(i * 7) % max(1, B // group_size)}" for i in range(B)], dtype=object)
    baseline = torch.randn(B, generator=gen, dtype=torch.float64)
    return dict(
        token_level_rewards=rewards, response_mask=mask, values=values, group_ids=group_ids, baseline_rewards=baseline
    )


def textbook_gae(rewards, values, mask, gamma, lam):
    """The per-timestep loop (verl), masked tokens skipped."""
    mask = mask.to(values.dtype)
    nextvalues = torch.zeros(values.shape[0], dtype=values.dtype)
    lastgaelam = torch.zeros_like(nextvalues)
    out = torch.zeros_like(values)
    for step in reversed(range(values.shape[1])):
        delta = rewards[:, step] + gamma * nextvalues - values[:, step]
        new = delta + gamma * lam * lastgaelam
        nextvalues = values[:, step] * mask[:, step] + (1 - mask[:, step]) * nextvalues
        lastgaelam = new * mask[:, step] + (1 - mask[:, step]) * lastgaelam
        out[:, step] = lastgaelam
    return out * mask


# ---- registry ---------------------------------------------------------------------------------


def test_every_documented_estimator_is_registered():
    assert set(ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS.names())


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: .*gae.*grpo"):
        get_advantage_estimator("ppo2")


def test_missing_input_names_the_field_and_estimator():
    with pytest.raises(ValueError, match="'gae' needs AdvantageInputs.values"):
        run("gae", token_level_rewards=t([[1.0]]), response_mask=t([[1.0]]))
    with pytest.raises(ValueError, match="'grpo' needs AdvantageInputs.group_ids"):
        run("grpo", token_level_rewards=t([[1.0]]), response_mask=t([[1.0]]))


def test_config_rejects_gamma_outside_unit_interval():
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5)


# ---- hand-computed cases ----------------------------------------------------------------------


def test_gae_gamma09_lam08_hand_computed():
    # δ = [0 + .9·.6 − .5, 0 + .9·.7 − .6, 1 − .7] = [.04, .03, .3];  A_t = δ_t + .72·A_{t+1}
    adv, ret = run(
        "gae",
        AdvantageConfig(gamma=0.9, lam=0.8, whiten_gae=False),
        token_level_rewards=t([[0, 0, 1]]),
        values=t([[0.5, 0.6, 0.7]]),
        response_mask=t([[1, 1, 1]]),
    )
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_skips_masked_tool_token_in_the_middle():
    # token 1 is not a step: V_next(0) = V_2 = .7, δ0 = .9·.7 − .5 = .13, A0 = .13 + .72·.3
    adv, ret = run(
        "gae",
        AdvantageConfig(gamma=0.9, lam=0.8, whiten_gae=False),
        token_level_rewards=t([[0, 99, 1]]),
        values=t([[0.5, 99, 0.7]]),
        response_mask=t([[1, 0, 1]]),
    )
    torch.testing.assert_close(adv, t([[0.346, 0.0, 0.3]]))
    torch.testing.assert_close(ret, t([[0.846, 0.0, 1.0]]))


def test_gae_whitened_has_zero_mean_unit_std_over_tokens():
    adv, _ = run(
        "gae",
        AdvantageConfig(gamma=0.9, lam=0.8),
        token_level_rewards=t([[0, 0, 1], [0, 2, 0]]),
        values=t([[0.5, 0.6, 0.7], [1, 1, 1]]),
        response_mask=t([[1, 1, 1], [1, 1, 0]]),
    )
    tokens = adv[torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()]
    assert abs(tokens.mean().item()) < 1e-9 and tokens.std().item() == pytest.approx(1.0, abs=1e-6)
    assert adv[1, 2] == 0


GROUP_CASE = dict(
    token_level_rewards=t([[0, 1, 0], [3, 0, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]),
    response_mask=t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]]),
    group_ids=["a", "b", "a", "a", "b"],  # a: scores 1, 0, 1 at rows 0, 2, 3;  b: 3, 1 at rows 1, 4
)


def per_row(adv):
    """The advantage each row carries on its first token."""
    return adv[:, 0]


def test_grpo_hand_computed_non_contiguous_groups():
    # a: mean 2/3, unbiased std 1/√3;  b: mean 2, std √2
    adv, ret = run("grpo", AdvantageConfig(eps=0.0), **GROUP_CASE)
    s3, s2 = 1 / math.sqrt(3), math.sqrt(2)
    torch.testing.assert_close(per_row(adv), t([(1 / 3) / s3, 1 / s2, (-2 / 3) / s3, (1 / 3) / s3, -1 / s2]))
    assert torch.equal(adv, ret)
    assert torch.all(adv[GROUP_CASE["response_mask"] == 0] == 0)


def test_dr_grpo_subtracts_group_mean_only():
    adv, _ = run("dr_grpo", **GROUP_CASE)
    torch.testing.assert_close(per_row(adv), t([1 / 3, 1, -2 / 3, 1 / 3, -1]))


def test_grpo_without_std_norm_equals_dr_grpo():
    adv, _ = run("grpo", AdvantageConfig(grpo_std_norm=False), **GROUP_CASE)
    torch.testing.assert_close(adv, run("dr_grpo", **GROUP_CASE)[0])


def test_rloo_hand_computed_leave_one_out_baseline():
    # row 0: 1 − mean(0, 1) = .5;  row 1: 3 − 1 = 2
    adv, _ = run("rloo", **GROUP_CASE)
    torch.testing.assert_close(per_row(adv), t([0.5, 2, -1, 0.5, -2]))


def test_singleton_group_gets_zero_advantage():
    case = dict(token_level_rewards=t([[5.0], [1.0], [2.0]]), response_mask=t([[1], [1], [1]]), group_ids=[0, 1, 1])
    for name in ["grpo", "dr_grpo", "rloo"]:
        assert run(name, **case)[0][0, 0] == 0, name


def test_grpo_zero_variance_group_gets_zero_advantage():
    adv, _ = run("grpo", token_level_rewards=t([[1.0], [1.0]]), response_mask=t([[1], [1]]), group_ids=[7, 7])
    assert torch.equal(adv, t([[0.0], [0.0]]))


def test_reinforce_plus_plus_hand_computed():
    # γ = .5: row 0 returns [1 + .5·2, 2] = [2, 2], row 1 [4]; whitened over tokens {2, 2, 4}
    adv, ret = run(
        "reinforce_plus_plus",
        AdvantageConfig(gamma=0.5),
        token_level_rewards=t([[1, 2], [4, 99]]),
        response_mask=t([[1, 1], [1, 0]]),
    )
    torch.testing.assert_close(ret, t([[2, 2], [4, 0]]))
    std = math.sqrt(4 / 3)
    torch.testing.assert_close(adv, t([[-2 / 3 / std, -2 / 3 / std], [4 / 3 / std, 0]]), atol=1e-6, rtol=1e-6)


def test_reinforce_plus_plus_baseline_hand_computed():
    # scores a: 1, 3 → centered −1, 1; b (alone): 0. Tokens {−1, −1, 1, 0, 0}: mean −.2, var .7
    adv, _ = run(
        "reinforce_plus_plus_baseline",
        token_level_rewards=t([[0, 1], [3, 0], [5, 0]]),
        response_mask=t([[1, 1], [1, 0], [1, 1]]),
        group_ids=["a", "a", "b"],
    )
    std = math.sqrt(0.7)
    expected = t([[-0.8, -0.8], [1.2, 0], [0.2, 0.2]]) / std
    expected[1, 1] = 0
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-6)


def test_remax_subtracts_greedy_baseline_from_reward_to_go():
    adv, ret = run(
        "remax",
        token_level_rewards=t([[0, 1], [0, 2]]),
        response_mask=t([[1, 1], [1, 1]]),
        baseline_rewards=t([0.5, 3.0]),
    )
    torch.testing.assert_close(ret, t([[1, 1], [2, 2]]))
    torch.testing.assert_close(adv, t([[0.5, 0.5], [-1, -1]]))


# ---- properties -------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**31), B=st.integers(1, 6), T=st.integers(1, 40))
def test_gae_lambda1_gamma1_equals_reward_to_go_minus_value(seed, B, T):
    inputs = random_inputs(seed, B, T)
    mask = inputs["response_mask"]
    adv, ret = run("gae", AdvantageConfig(gamma=1.0, lam=1.0, whiten_gae=False), **inputs)
    rewards = inputs["token_level_rewards"] * mask
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, (reward_to_go - inputs["values"]) * mask)
    torch.testing.assert_close(ret, reward_to_go * mask)


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(1, 6),
    T=st.integers(1, 60),
    gamma=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.3, 0.0]),
)
def test_gae_matches_textbook_loop_with_holes(seed, B, T, gamma, lam):
    inputs = random_inputs(seed, B, T)
    adv, _ = run("gae", AdvantageConfig(gamma=gamma, lam=lam, whiten_gae=False), **inputs)
    expected = textbook_gae(inputs["token_level_rewards"], inputs["values"], inputs["response_mask"], gamma, lam)
    torch.testing.assert_close(adv, expected)


@FAST
@given(
    seed=st.integers(0, 2**31),
    T=st.integers(1, 50),
    chunk=st.integers(1, 9),
    discount=st.sampled_from([0.999, 0.9, 0.3]),
)
def test_discounted_cumsum_any_chunk_length_matches_loop(seed, T, chunk, discount):
    inputs = random_inputs(seed, 3, T)
    x, mask = inputs["token_level_rewards"], inputs["response_mask"]
    expected = textbook_gae(x, torch.zeros_like(x), mask, 1.0, discount)  # V = 0: a discounted sum
    torch.testing.assert_close(discounted_cumsum(x, mask, discount, chunk=chunk), expected)


def test_discounted_cumsum_long_float32_sequence_stays_finite_and_accurate():
    x = torch.randn(2, 5000)
    mask = torch.ones(2, 5000, dtype=torch.bool)
    expected = textbook_gae(x.double(), torch.zeros(2, 5000, dtype=torch.float64), mask, 1.0, 0.95)
    got = discounted_cumsum(x, mask, 0.95)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


def pad_with_garbage(inputs, seed, extra):
    """Append `extra` masked-out columns and overwrite every masked-out slot with NaN/inf/huge values."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.nn.functional.pad(inputs["response_mask"], (0, extra), value=False)
    padded = dict(inputs, response_mask=mask)
    for key in ("token_level_rewards", "values"):
        x = torch.nn.functional.pad(inputs[key], (0, extra))
        garbage = torch.randn(x.shape, generator=gen, dtype=x.dtype) * 1e6
        garbage.view(-1)[::3] = math.nan
        garbage.view(-1)[1::5] = math.inf
        padded[key] = torch.where(mask, x, garbage)
    return padded


@FAST
@given(
    seed=st.integers(0, 2**31),
    B=st.integers(1, 6),
    T=st.integers(1, 30),
    extra=st.integers(0, 7),
    name=st.sampled_from(ESTIMATORS),
)
def test_padding_with_garbage_never_changes_advantages_or_returns(seed, B, T, extra, name):
    inputs = random_inputs(seed, B, T)
    cfg = AdvantageConfig(gamma=0.97, lam=0.9)
    adv, ret = run(name, cfg, **inputs)
    adv_p, ret_p = run(name, cfg, **pad_with_garbage(inputs, seed, extra))
    torch.testing.assert_close(adv_p[:, :T], adv)
    torch.testing.assert_close(ret_p[:, :T], ret)
    assert torch.all(adv_p[:, T:] == 0) and torch.all(ret_p[:, T:] == 0)


@FAST
@given(seed=st.integers(0, 2**31), B=st.integers(2, 12), group_size=st.integers(1, 4))
def test_grpo_advantages_have_zero_mean_per_group(seed, B, group_size):
    inputs = random_inputs(seed, B, 5, group_size=group_size)
    for name in ["grpo", "dr_grpo", "rloo"]:
        adv, _ = run(name, **inputs)
        rows = per_row(adv)
        for gid in set(inputs["group_ids"]):
            members = torch.tensor(inputs["group_ids"] == gid)
            assert abs(rows[members].mean().item()) < 1e-9, (name, gid)


@FAST
@given(seed=st.integers(0, 2**31), B=st.integers(1, 12), name=st.sampled_from(GROUPED + ["gae", "remax"]))
def test_permuting_rows_permutes_advantages(seed, B, name):
    inputs = random_inputs(seed, B, 6)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    shuffled = {k: v[perm] if isinstance(v, torch.Tensor) else v[perm.numpy()] for k, v in inputs.items()}
    adv, ret = run(name, **inputs)
    adv_s, ret_s = run(name, **shuffled)
    torch.testing.assert_close(adv_s, adv[perm])
    torch.testing.assert_close(ret_s, ret[perm])


def test_integer_tensor_group_ids_match_string_ids():
    ints = dict(GROUP_CASE, group_ids=torch.tensor([10, 20, 10, 10, 20]))
    torch.testing.assert_close(run("grpo", **ints)[0], run("grpo", **GROUP_CASE)[0])


def test_float32_and_bool_mask_inputs_give_float32_outputs():
    adv, ret = run(
        "gae",
        token_level_rewards=torch.zeros(2, 3),
        values=torch.ones(2, 3),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
    )
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
