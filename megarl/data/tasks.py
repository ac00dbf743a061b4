"""Generated tasks a tiny model can learn with RL in minutes on CPU: `arithmetic`, `countdown` and
`tool_arithmetic` (products only a calculator tool gets right, for the `tool_agent` loop).

Owns the row generators (`make_arithmetic_dataset`, `make_countdown_dataset`,
`make_tool_arithmetic_dataset`, `make_task_dataset`)
and `write_task_splits` (train/test parquet). Rows have the columns every prompt dataset has:
`prompt` (chat messages, or a raw string with `chat=False`), `ground_truth` (a string),
`data_source` (the name of the matching reward in `megarl.rewards`) and `extra_info`.
Generation is deterministic in `seed`. Pure Python (+ pyarrow to write files).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Callable

from megarl.rewards.tasks import evaluate_equation

ARITHMETIC_OPS = ("+", "-", "*")


def _prompt(content: str, chat: bool) -> str | list[dict[str, str]]:
    return [{"role": "user", "content": content}] if chat else content


def make_arithmetic_dataset(
    n: int,
    seed: int = 0,
    max_operand: int = 4,
    ops: tuple[str, ...] = ("+",),
    chat: bool = True,
    num_operands: int = 2,
) -> list[dict[str, Any]]:
    """`n` problems like "a+b=" with operands in [0, max_operand]; the answer is the integer, as digits.

    `num_operands` operands joined by operators drawn from `ops` ("3+5+8=" with 3; `*` binds tighter,
    as in Python). The default (sums 0-8, one digit) is what a 2-layer, hidden-64 model learnt from
    scratch with GRPO on CPU in a few hundred steps, but it has only 25 distinct problems; the
    quickstart uses three operands 0-9 (1,000 distinct problems, sums 0-27).
    """
    bad = [op for op in ops if op not in ARITHMETIC_OPS]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of {ARITHMETIC_OPS}, got {ops}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    rng = random.Random(seed)
    return [_arithmetic_row(rng, i, max_operand, ops, chat, num_operands) for i in range(n)]


def _arithmetic_row(
    rng: random.Random, index: int, max_operand: int, ops: tuple[str, ...], chat: bool, num_operands: int = 2
) -> dict[str, Any]:
    operands = [rng.randint(0, max_operand) for _ in range(2)]
    operators = [rng.choice(ops)]
    for _ in range(num_operands - 2):  # draw order of the two-operand case kept: same seed, same problems
        operands.append(rng.randint(0, max_operand))
        operators.append(rng.choice(ops))
    expression = "".join(f"{x}{op}" for x, op in zip(operands, operators)) + str(operands[-1])
    return {
        "prompt": _prompt(f"{expression}=", chat),
        "ground_truth": str(int(evaluate_equation(expression))),
        "data_source": "arithmetic",
        "extra_info": {
            "index": index,
            "a": operands[0],
            "b": operands[1],
            "op": operators[0],
            "operands": operands,
            "ops": operators,
        },
    }


def _random_equation(rng: random.Random, numbers: list[int]) -> str:
    """A random fully parenthesised equation using each of `numbers` once, with + - *."""
    terms = [str(x) for x in numbers]
    rng.shuffle(terms)
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        terms[i : i + 2] = [f"({terms[i]}{rng.choice('+-*')}{terms[i + 1]})"]
    return terms[0][1:-1] if terms[0].startswith("(") else terms[0]


def make_countdown_dataset(
    n: int,
    seed: int = 0,
    num_numbers: int = 3,
    max_number: int = 9,
    max_target: int = 99,
    chat: bool = True,
) -> list[dict[str, Any]]:
    """`n` countdown problems: reach a target from `num_numbers` numbers in [1, max_number].

    Targets come from a random equation over all the numbers, so each problem is solvable; the
    ground truth is JSON `{"target", "numbers"}` and the solution equation is in `extra_info`.
    """
    if num_numbers < 2:
        raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        problem = _countdown_problem(rng, num_numbers, max_number, max_target)
        if problem is not None:
            rows.append(_countdown_row(*problem, index=len(rows), chat=chat))
    return rows


def _countdown_row(numbers: list[int], equation: str, target: int, index: int, chat: bool) -> dict[str, Any]:
    content = (
        f"Using the numbers {numbers}, write an equation that equals {target}. "
        "Use each number exactly once, with + - * / and parentheses. "
        "Give the equation in <answer></answer>."
    )
    return {
        "prompt": _prompt(content, chat),
        "ground_truth": json.dumps({"target": target, "numbers": numbers}),
        "data_source": "countdown",
        "extra_info": {"index": index, "solution": equation},
    }


def _countdown_problem(rng: random.Random, num_numbers: int, max_number: int, max_target: int):
    """(numbers, a solution equation, target), or None when the drawn target is out of range."""
    numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
    equation = _random_equation(rng, numbers)
    target = evaluate_equation(equation)
    if target is None or target.denominator != 1 or not 0 < target <= max_target:
        return None
    return numbers, equation, int(target)


def make_tool_arithmetic_dataset(
    n: int,
    seed: int = 0,
    digits: tuple[int, int] = (3, 2),
    chat: bool = False,
    agent_name: str = "tool_agent",
    full_width: bool = True,
) -> list[dict[str, Any]]:
    """`n` products like "347*29=" of a `digits[0]`-digit and a `digits[1]`-digit number: far beyond what a
    tiny model computes, exact with the `calculator` tool. Rows carry `agent_name` (the loop that offers
    the tools) and `data_source` "tool_arithmetic" (its reward reads the model's final turn). With
    `full_width` every product has digits[0] + digits[1] digits, so every answer copied from the tool's
    result has one length (a tiny model learns a fixed-width copy far sooner than a variable one)."""
    if len(digits) != 2 or min(digits) < 1:
        raise ValueError(f"digits must be two positive digit counts (first factor, second factor), got {digits}")
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        while full_width and len(str(a * b)) < sum(digits):
            a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        rows.append(
            {
                "prompt": _prompt(f"{a}*{b}=", chat),
                "ground_truth": str(a * b),
                "data_source": "tool_arithmetic",
                "agent_name": agent_name,
                "extra_info": {"index": index, "expression": f"{a}*{b}"},
            }
        )
    return rows


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": make_arithmetic_dataset,
    "countdown": make_countdown_dataset,
    "tool_arithmetic": make_tool_arithmetic_dataset,
}


def make_task_dataset(task: str, n: int, seed: int = 0, **kwargs) -> list[dict[str, Any]]:
    """Rows of the generated task `task` (see `TASKS`)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {sorted(TASKS)}")
    return TASKS[task](n, seed=seed, **kwargs)


HOLDOUTS = ("samples", "problems")


def write_task_splits(
    task: str, n: int, out_dir: str, seed: int = 0, test_fraction: float = 0.1, holdout: str = "samples", **kwargs
) -> dict[str, str]:
    """Write `n` rows as `train.parquet` + `test.parquet` (a `test_fraction` share) in `out_dir`.

    `holdout="samples"`: the test split is drawn from the same distribution with another seed
    (held-out samples; single-digit addition has only 100 distinct problems, so the splits share
    problems). `holdout="problems"`: the test rows are distinct problems and no train row repeats
    one of them (train rows may repeat each other). Returns the paths.
    """
    from megarl.data.datasets import save_rows

    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if holdout not in HOLDOUTS:
        raise ValueError(f"holdout must be one of {HOLDOUTS}, got {holdout!r}")
    n_test = max(1, round(n * test_fraction))
    test_seed = seed + 1_000_003
    if holdout == "samples":
        splits = {
            "train": make_task_dataset(task, n - n_test, seed=seed, **kwargs),
            "test": make_task_dataset(task, n_test, seed=test_seed, **kwargs),
        }
    else:
        test = _draw_rows(task, n_test, test_seed, kwargs, distinct=True)
        exclude = {_problem_key(row) for row in test}
        splits = {"train": _draw_rows(task, n - n_test, seed, kwargs, exclude=exclude), "test": test}
    paths = {name: os.path.join(out_dir, f"{name}.parquet") for name in splits}
    for name, rows in splits.items():
        save_rows(rows, paths[name])
    return paths


def _problem_key(row: dict[str, Any]) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def _draw_rows(
    task: str, n: int, seed: int, kwargs: dict, exclude: frozenset | set = frozenset(), distinct: bool = False
) -> list[dict[str, Any]]:
    """The first `n` rows of the task's stream (deterministic in `seed`) whose problem is not in
    `exclude` (and, with `distinct`, not already taken)."""
    draws = n
    while True:
        rows, taken = [], set(exclude)
        for row in make_task_dataset(task, draws, seed=seed, **kwargs):
            key = _problem_key(row)
            if key not in taken:
                rows.append(row)
                if distinct:
                    taken.add(key)
            if len(rows) == n:
                return rows
        if draws >= 64 * n:
            raise ValueError(
                f"{task}: only {len(rows)} of the {n} rows needed are distinct problems outside the "
                f"test split in {draws} draws: the task has too few problems for holdout='problems' "
                "at this size; lower n or test_fraction, widen the task (max_operand, num_operands), "
                "or use holdout='samples'"
            )
        draws *= 4
