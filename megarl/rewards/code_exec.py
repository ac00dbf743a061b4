"""The `code` reward: run the response's Python code block against stdin/stdout test cases.

Ground truth is JSON: a list of `{"input": str, "output": str}` cases (or the APPS-style
`{"inputs": [...], "outputs": [...]}`). Each case runs in a fresh `sandbox.run_python`; the score
is the fraction of cases whose stdout matches (trailing whitespace per line ignored). After a
case times out the remaining cases count as failed without running (`extra["stop_on_timeout"]`,
default true), so a hung solution costs one timeout, not one per case. Give the reward runner a
per-sample timeout above `cases × timeout_s` when that is off.
"""

from __future__ import annotations

import json
import re

from megarl.rewards.registry import register_reward
from megarl.rewards.sandbox import SandboxConfig, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python ... ```) of `text`, or None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


def parse_test_cases(ground_truth: str | list | dict) -> list[dict[str, str]]:
    """Test cases as `[{"input", "output"}]` from the JSON ground truth (list or inputs/outputs)."""
    data = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(data, dict) and "inputs" in data and "outputs" in data:
        data = [{"input": i, "output": o} for i, o in zip(data["inputs"], data["outputs"])]
    if not isinstance(data, list) or not all(isinstance(c, dict) and {"input", "output"} <= c.keys() for c in data):
        raise ValueError("code ground truth must be a JSON list of {'input': str, 'output': str} test cases")
    return data


def outputs_match(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def lines(s: str) -> list[str]:
        return [ln.rstrip() for ln in s.rstrip().splitlines()]

    return lines(actual) == lines(expected)


def _sandbox_config(extra: dict) -> SandboxConfig:
    extra = extra or {}
    return SandboxConfig(
        timeout_s=float(extra.get("timeout_s", 5.0)),
        memory_mb=int(extra.get("memory_mb", 1024)),
    )


@register_reward("code")
def code_reward(solution_str: str, ground_truth: str, extra: dict) -> dict:
    """Fraction of test cases the response's code passes (0.0 without a code block)."""
    cases = parse_test_cases(ground_truth)
    code = extract_code(solution_str)
    if code is None or not cases:
        return {"score": 0.0, "acc": 0.0, "has_code": float(code is not None)}
    config, passed = _sandbox_config(extra), 0
    for case in cases:
        result = run_python(code, stdin=str(case["input"]), config=config)
        passed += int(result.ok and outputs_match(result.stdout, str(case["output"])))
        if result.timed_out and (extra or {}).get("stop_on_timeout", True):
            break
    rate = passed / len(cases)
    return {"score": rate, "acc": float(passed == len(cases)), "has_code": 1.0}
