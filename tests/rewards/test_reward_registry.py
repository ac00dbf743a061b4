import pytest

from megarl.rewards import get_reward_fn, list_rewards, normalize_result, register_reward


def test_builtin_rewards_are_registered():
    assert {"gsm8k", "gsm8k_flexible", "math", "arithmetic", "countdown", "code"} <= set(list_rewards())


def test_unknown_reward_name_raises_listing_valid_names():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*gsm8k.*math"):
        get_reward_fn("nope")


def test_data_source_alias_resolves_to_builtin():
    assert get_reward_fn("openai/gsm8k") is get_reward_fn("gsm8k")


def test_dotted_module_path_loads_function():
    fn = get_reward_fn("megarl.rewards.math_answer:math_reward")
    assert fn("\\boxed{2}", "2", {})["score"] == 1.0


def test_file_path_loads_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length_reward(s, gt, extra):\n    return len(s) / 10\n")
    assert get_reward_fn(f"{path}:length_reward")("abcde", "", {}) == 0.5


def test_missing_file_or_attribute_raises_clearly(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        get_reward_fn(f"{tmp_path}/absent.py:fn")
    with pytest.raises(ValueError, match="has no callable 'absent'"):
        get_reward_fn("megarl.rewards.math_answer:absent")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward_fn("no_such_module_xyz:fn")


def test_register_same_name_twice_with_other_fn_raises():
    @register_reward("test_only_reward")
    def first(s, gt, extra):
        return 1.0

    register_reward("test_only_reward")(first)  # re-registering the same fn is fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_only_reward")(lambda s, gt, extra: 0.0)
    assert get_reward_fn("test_only_reward") is first


def test_normalize_result_accepts_float_bool_and_dict_with_score():
    assert normalize_result(True) == {"score": 1.0}
    assert normalize_result({"score": 1, "acc": 0.5}) == {"score": 1.0, "acc": 0.5}
    with pytest.raises(ValueError, match="without 'score'"):
        normalize_result({"acc": 1.0})
    with pytest.raises(TypeError):
        normalize_result("1.0")
