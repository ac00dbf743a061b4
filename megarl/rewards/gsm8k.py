"""GSM8K answer extraction and the `gsm8k` / `gsm8k_flexible` rewards.

Strict mode reads the number after the last `####` (the format the GSM8K prompt asks for);
flexible mode takes the last number anywhere in the response. Answers compare numerically, so
`18`, `18.00` and `$18` are equal, and so are `1,018` and `1018`. Pure Python.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megarl.rewards.registry import register_reward

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_gsm8k_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer of a GSM8K response (`mode` 'strict': after `####`; 'flexible': last number)."""
    if mode == "strict":
        matches = _STRICT.findall(text)
    elif mode == "flexible":
        matches = _NUMBER.findall(text)
    else:
        raise ValueError(f"gsm8k extraction mode must be 'strict' or 'flexible', got {mode!r}")
    return _clean_number(matches[-1]) if matches else None


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "").rstrip(".")


def numbers_equal(pred: str | None, truth: str) -> bool:
    """Exact numeric equality of two decimal strings (falls back to string equality)."""
    if pred is None:
        return False
    try:
        return Fraction(_clean_number(pred)) == Fraction(_clean_number(truth.strip()))
    except (ValueError, ZeroDivisionError):
        return pred.strip() == truth.strip()


def _score(solution_str: str, ground_truth: str, extra: dict, mode: str) -> dict:
    pred = extract_gsm8k_answer(solution_str, mode)
    correct = numbers_equal(pred, ground_truth)
    format_score = float(extra.get("format_score", 0.0)) if extra else 0.0
    score = 1.0 if correct else (format_score if pred is not None else 0.0)
    return {"score": score, "acc": float(correct), "has_answer": float(pred is not None)}


@register_reward("gsm8k")
def gsm8k_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """1.0 when the number after the last `####` equals the ground truth (`extra['format_score']`
    is given to a well-formatted wrong answer, default 0)."""
    return _score(solution_str, ground_truth, extra, "strict")


@register_reward("gsm8k_flexible")
def gsm8k_flexible_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """1.0 when the last number in the response equals the ground truth."""
    return _score(solution_str, ground_truth, extra, "flexible")
