"""Math answer extraction and equivalence: the `math` reward (MATH-style `\\boxed{}` answers).

Owns `extract_boxed` (last `\\boxed{...}` / `\\fbox{...}`, nested braces), `normalize_answer`
(LaTeX and formatting noise removed, so equal answers compare equal as strings) and `is_equiv`
(string equality after normalisation, then exact numeric comparison, then element-wise for
tuples/intervals). Pure Python, no dependencies.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megarl.rewards.registry import register_reward

_UNIT_WORDS = (
    "square|sq|cubic|units?|inch(?:es)?|in|feet|foot|ft|yards?|yd|miles?|mi|mph|meters?|m|cm|mm|km|"
    "grams?|gm|g|kg|pounds?|lbs?|ounces?|oz|liters?|ml|seconds?|sec|s|minutes?|min|hours?|hr|days?|"
    "weeks?|months?|years?|degrees?|dollars?|cents?|points?|ways|students|people|digits|integers|"
    "numbers|edges|meals|multiples|tickets|sides|times"
)
_TRAILING_UNITS = re.compile(r"^(.*?\d)\s*(?:(?:" + _UNIT_WORDS + r")\b\s*)+(?:\^\{?[23]\}?)?$")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "\\%", "%")
_DEGREES = ("^{\\circ}", "^\\circ", "°", "{}^\\circ")


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}`/`\\fbox{...}` (or `\\boxed 5`) in `text`, wrapper included."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed ") and not rest[len("\\boxed ") :].lstrip().startswith("{"):
        return "\\boxed " + re.split(r"[\s$]", rest[len("\\boxed ") :].lstrip(), maxsplit=1)[0]
    end = _matching_brace(rest, rest.find("{"))
    return None if end is None else rest[: end + 1]


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept), or None."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    return boxed[boxed.index("{") + 1 : -1]


def _matching_brace(s: str, start: int) -> int | None:
    """Index of the `}` closing the `{` at `start`, or None if unbalanced / no brace."""
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        if depth == 0:
            return i
    return None


def normalize_answer(answer: str) -> str:
    """Canonical string form of a math answer (see the module docstring for what is removed)."""
    s = _unwrap_boxed(str(answer).strip())
    s = s.replace("\n", "").replace("\\\\", "\\").replace("\\ ", " ")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    for token in _NOISE + _DEGREES:
        s = s.replace(token, "")
    s = _strip_text_units(s)
    s = _strip_lhs(s).strip().rstrip(".").strip()
    s = _fix_sqrt(_fix_fracs(s.replace(" ", "")))
    s = _fix_slash_fraction(_fix_numbers(s))
    return s


def _unwrap_boxed(s: str) -> str:
    inner = extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    return inner if inner is not None and last_boxed(s) == s else s


def _strip_text_units(s: str) -> str:
    """Drop a unit after a number ("5 \\text{ cm}", "10 dollars"), then unwrap \\text{...}."""
    units = re.match(r"^(.*?\d)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]+\}(\^\{?[23]\}?)?$", s)
    if units:
        s = units.group(1)
    s = _TEXT_WRAPPERS.sub(lambda m: m.group(1), s)
    units = _TRAILING_UNITS.match(s.strip())
    return units.group(1) if units else s


def _strip_lhs(s: str) -> str:
    """`x = 5` -> `5` when the left-hand side is a short variable name."""
    parts = s.split("=")
    if len(parts) == 2 and re.fullmatch(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*", parts[0]):
        return parts[1]
    return s


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{b}` -> `\\frac{1}{b}` (one-character arguments)."""
    return re.sub(r"\\frac(\{[^{}]*\}|[^{\s\\])(\{[^{}]*\}|[^{\s\\])", _brace_frac_args, s)


def _brace_frac_args(m: re.Match) -> str:
    a, b = (x if x.startswith("{") else "{" + x + "}" for x in m.groups())
    return f"\\frac{a}{b}"


def _fix_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`; one-character `^{2}` / `_{n}` -> `^2` / `_n`."""
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)
    return re.sub(r"\\sqrt([^{\s\\])", r"\\sqrt{\1}", s)


def _fix_numbers(s: str) -> str:
    """Thousands separators, leading `.5`, trailing `.0`, a leading `+`."""
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s) or re.fullmatch(r"[-+]?\d{1,3}(\{,\}\d{3})+", s):
        s = s.replace("{,}", "").replace(",", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = re.sub(r"^([-+]?\d+)\.0*$", r"\1", s)
    s = re.sub(r"^([-+]?\d+\.\d*?[1-9])0+$", r"\1", s)
    return s[1:] if re.fullmatch(r"\+\d+(\.\d+)?", s) else s


def _fix_slash_fraction(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` for integer numerator and denominator."""
    m = re.fullmatch(r"(-?)(\d+)/(\d+)", s)
    return f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}" if m else s


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised answer that is an integer, decimal or (signed) fraction."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            sign = -1 if m.group(1) else 1
            return sign * Fraction(int(m.group(2)), int(m.group(3)))
        if re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", s):
            return Fraction(s)
    except (ZeroDivisionError, ValueError):
        return None
    return None


def is_equiv(pred: str | None, truth: str | None) -> bool:
    """True when two answers are the same after normalisation (numerically or element-wise)."""
    if pred is None or truth is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(truth)
    if a == b:
        return True
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb or abs(float(na) - float(nb)) <= 1e-9 * max(1.0, abs(float(nb)))
    return _tuple_equiv(a, b)


def _tuple_equiv(a: str, b: str) -> bool:
    """Element-wise equivalence of `(x, y)` / `[x, y)` style tuples and intervals."""
    if len(a) < 2 or len(b) < 2 or a[0] + a[-1] != b[0] + b[-1] or a[0] not in "([" or a[-1] not in ")]":
        return False
    xs, ys = _split_top_level(a[1:-1]), _split_top_level(b[1:-1])
    return len(xs) == len(ys) > 1 and all(is_equiv(x, y) for x, y in zip(xs, ys))


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"{": 1, "(": 1, "[": 1, "}": -1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


@register_reward("math")
def math_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """1.0 when the last `\\boxed{}` answer of the response is equivalent to the ground truth."""
    pred = extract_boxed(solution_str)
    correct = is_equiv(pred, ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "has_answer": float(pred is not None)}
