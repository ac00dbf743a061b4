import pytest

from megarl.rewards import get_reward_fn
from megarl.rewards.gsm8k import extract_gsm8k_answer
from megarl.rewards.math_answer import extract_boxed, is_equiv, normalize_answer

EQUIVALENT = [
    (r"\frac{1}{2}", "1/2"),
    (r"\dfrac{1}{2}", "0.5"),
    (r"\tfrac12", r"\frac{1}{2}"),
    (r"-\frac{2}{4}", "-1/2"),
    ("5.0", "5"),
    ("1.50", "1.5"),
    (".5", "0.5"),
    ("10.", "10"),
    ("1,000", "1000"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"\$5", "5"),
    ("$5$", "5"),
    (r"5 \text{ cm}", "5"),
    ("10 dollars", "10"),
    ("12 cm^2", "12"),
    (r"10\%", "10"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"(\frac12, 3]", "(0.5,3]"),
    ("x = 3", "3"),
    ("y = 2x+1", "2x+1"),
    (r"\sqrt3", r"\sqrt{3}"),
    (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}"),
    (r"x^{2}+1", "x^2+1"),
    (r"\!5", "5"),
    (r"\text{(A)}", "(A)"),
    (r"\boxed{7}", "7"),
    ("1e-3", "0.001"),
]
DIFFERENT = [
    ("3", "4"),
    (r"\frac{1}{3}", "0.33"),
    ("2x", "2"),
    ("(1,2)", "(2,1)"),
    ("-3", "3"),
    ("1/0", "1"),
    (r"\sqrt{2}", r"\sqrt{3}"),
]


@pytest.mark.parametrize("pred,truth", EQUIVALENT)
def test_is_equiv_true_for_equivalent_forms(pred, truth):
    assert is_equiv(pred, truth), (normalize_answer(pred), normalize_answer(truth))
    assert is_equiv(truth, pred)


@pytest.mark.parametrize("pred,truth", DIFFERENT)
def test_is_equiv_false_for_different_answers(pred, truth):
    assert not is_equiv(pred, truth), (normalize_answer(pred), normalize_answer(truth))


def test_is_equiv_none_is_never_equivalent():
    assert not is_equiv(None, "1")


def test_extract_boxed_takes_last_with_nested_braces():
    text = r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} done"
    assert extract_boxed(text) == r"\frac{1}{\sqrt{2}}"


def test_extract_boxed_handles_fbox_space_form_and_absence():
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed(r"so \boxed 5$.") == "5"
    assert extract_boxed("no answer") is None
    assert extract_boxed(r"\boxed{unbalanced") is None


def test_math_reward_scores_boxed_answer():
    fn = get_reward_fn("math")
    assert fn(r"... so the answer is $\boxed{\dfrac{3}{4}}$.", "3/4", {})["score"] == 1.0
    wrong = fn(r"\boxed{0.7}", "3/4", {})
    assert wrong["score"] == 0.0 and wrong["has_answer"] == 1.0
    assert fn("3/4 without a box", "3/4", {})["has_answer"] == 0.0


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1234"),
        ("#### $18.", "18", "18"),
        ("#### -5", "-5", "-5"),
        ("The answer is 42.", None, "42"),
        ("first #### 3 then #### 4", "4", "4"),
        ("no number at all", None, None),
    ],
)
def test_gsm8k_extraction_strict_and_flexible(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_extraction_unknown_mode_raises():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_gsm8k_answer("#### 1", "fuzzy")


def test_gsm8k_reward_compares_numerically_and_flexible_mode_needs_no_marker():
    strict, flexible = get_reward_fn("gsm8k"), get_reward_fn("gsm8k_flexible")
    assert strict("#### 18.00", "18", {})["score"] == 1.0
    assert strict("The answer is 18", "18", {})["score"] == 0.0
    assert flexible("The answer is 18", "18", {})["score"] == 1.0
    assert strict("#### 17", "18", {"format_score": 0.1})["score"] == 0.1
