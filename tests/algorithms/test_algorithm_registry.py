"""Registries: one signature per kind, unknown names list valid ones, dotted-path loading."""

import pytest

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
)
from megarl.utils.registry import Registry


def user_estimator(inputs, cfg):
    """A user-defined estimator loaded by dotted path in the tests below."""
    return inputs, cfg


def test_unknown_policy_loss_lists_every_valid_name():
    with pytest.raises(ValueError) as err:
        get_policy_loss("ppo")
    for name in ["ppo_clip", "gspo", "cispo"]:
        assert name in str(err.value)


def test_unknown_kl_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="abs, k1, k2, k3"):
        get_kl_estimator("k4")


def test_dotted_path_loads_user_function():
    assert get_advantage_estimator(f"{__name__}:user_estimator") is user_estimator


def test_dotted_path_to_missing_module_or_attribute_raises_value_error():
    with pytest.raises(ValueError, match="cannot load advantage estimator"):
        get_advantage_estimator("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="cannot load"):
        get_advantage_estimator(f"{__name__}:missing")


def test_dotted_path_with_wrong_signature_is_rejected():
    with pytest.raises(TypeError, match=r"must accept \(inputs, cfg, agg\)"):
        get_policy_loss(f"{__name__}:user_estimator")


def test_register_checks_signature_and_duplicates():
    def first(a, b):
        return a

    def second(a, b):
        return b

    registry = Registry("thing", ("a", "b"))
    registry.register("two")(first)
    registry.register("two")(first)  # the same function again (e.g. a module reload) is fine
    with pytest.raises(TypeError, match="must accept"):
        registry.register("one")(lambda a: a)
    with pytest.raises(ValueError, match="already registered to .*first"):
        registry.register("two")(second)
    assert "two" in registry and registry.names() == ["two"]


def test_registries_hold_the_documented_members():
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"} <= set(
        ADVANTAGE_ESTIMATORS.names()
    )
    assert {"ppo_clip", "gspo", "cispo"} <= set(POLICY_LOSSES.names())
    assert {"k1", "k2", "k3", "low_var_kl", "abs"} <= set(KL_ESTIMATORS.names())
    assert set(LOSS_AGGREGATIONS.names()) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }


def test_algorithms_import_without_megatron_vllm_or_ray():
    import subprocess
    import sys

    code = (
        "import sys, megarl.algorithms, megarl.algorithms.dapo, megarl.data.batch, megarl.data.balancing; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'vllm', 'ray')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
