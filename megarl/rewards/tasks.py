"""Rewards of the generated tasks in `megarl.data.tasks`: `arithmetic`, `countdown` and `tool_arithmetic`.

Both give a tiny model trained from scratch a signal it can climb: an arithmetic answer counts
when it is the last integer of the response (a clean bare answer scores a little more), and a
parseable but wrong countdown equation earns `format_score` (from `extra`, default 0.1). The countdown
equation is evaluated with exact fractions by walking its AST (never `eval`). Pure Python.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter
from fractions import Fraction

from megarl.rewards.registry import register_reward

DEFAULT_FORMAT_SCORE = 0.1
DEFAULT_VERBOSE_PENALTY = 0.1
_INT = re.compile(r"-?\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EQUATION_CHARS = re.compile(r"[\d+\-*/() .]+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _format_score(extra: dict | None) -> float:
    return float((extra or {}).get("format_score", DEFAULT_FORMAT_SCORE))


@register_reward("arithmetic")
def arithmetic_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """1.0 when the response is exactly the answer; 1.0 - `extra["verbose_penalty"]` (default 0.1)
    when the answer is its last integer amid other text; 0.0 for any wrong answer.

    Wrong answers get nothing on purpose: in a GRPO check with a tiny model trained from scratch,
    a flat format bonus was hacked into endless digit strings ("6666"), and partial credit by
    closeness collapsed the policy onto the most common answer; with this reward it learnt.
    """
    response, answer = solution_str.strip(), int(str(ground_truth).strip())
    numbers = _INT.findall(response)
    correct = bool(numbers) and int(numbers[-1]) == answer
    clean = _INT.fullmatch(response) is not None
    penalty = float((extra or {}).get("verbose_penalty", DEFAULT_VERBOSE_PENALTY))
    score = (1.0 if clean else 1.0 - penalty) if correct else 0.0
    return {"score": score, "acc": float(correct)}


@register_reward("tool_arithmetic")
def tool_arithmetic_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """The `arithmetic` reward on the model's own final turn: `extra["final_response"]` (set by the
    `tool_agent` loop: the text of the last assistant turn, tool-call markup removed), else the whole
    response. Reading only the final turn matters: the calculator's result sits in the tool turn, and a
    trajectory cut off right after it must not score with the tool's answer."""
    final = (extra or {}).get("final_response")
    return arithmetic_reward(solution_str if final is None else str(final), ground_truth, extra)


def extract_equation(text: str) -> str | None:
    """The equation in the last `<answer>...</answer>` (else the last line), without `= target`."""
    tags = _ANSWER_TAG.findall(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    candidate = tags[-1] if tags else (lines[-1] if lines else "")
    candidate = candidate.split("=")[0].strip()
    return candidate if candidate and _EQUATION_CHARS.fullmatch(candidate) else None


def evaluate_equation(equation: str) -> Fraction | None:
    """Exact value of an equation of integers, + - * / and parentheses; None if invalid."""
    try:
        return _eval_node(ast.parse(equation, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _eval_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def parse_countdown_truth(ground_truth: str | dict) -> tuple[int, list[int], bool]:
    """(target, numbers, use_all) from the ground truth JSON `{"target", "numbers", "use_all"?}`."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    return int(truth["target"]), [int(n) for n in truth["numbers"]], bool(truth.get("use_all", True))


@register_reward("countdown")
def countdown_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """1.0 when the answer equation uses the given numbers (each at most once; all of them when
    `use_all`) and equals the target; `format_score` for a parseable equation that does not."""
    target, numbers, use_all = parse_countdown_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return {"score": 0.0, "acc": 0.0}
    used = Counter(int(n) for n in re.findall(r"\d+", equation))
    allowed = Counter(numbers)
    numbers_ok = used == allowed if use_all else not (used - allowed)
    correct = numbers_ok and evaluate_equation(equation) == target
    return {"score": 1.0 if correct else _format_score(extra), "acc": float(correct)}
