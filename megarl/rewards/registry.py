"""The reward-function registry: one signature for every rule reward, lookup by name or path.

Every reward function has the signature

    fn(solution_str: str, ground_truth: str, extra: dict) -> float | dict

`solution_str` is the decoded response, `ground_truth` the dataset's ground-truth string and
`extra` the row's other columns (data_source, extra_info, ...). A dict result must hold `score`;
its other numeric entries (e.g. `acc`, `format`) are logged as metrics, overall and per data source.
`get_reward_fn` accepts a registered name, `pkg.module:fn`, or `path/to/file.py:fn` (user code).

Batch-level reward functions (`BATCH_REWARDS`, `register_batch_reward`, `get_batch_reward_fn`) get a
whole step at once, for a judge model or a remote service that batches or parallelises itself:

    fn(solution_strs: list[str], ground_truths: list, extras: list[dict]) -> list[float | dict]

one result per sample, in order (each extra holds the row's data_source). Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any, Callable

from megarl.utils.registry import Registry

RewardFn = Callable[[str, str, dict], "float | dict[str, Any]"]

REWARDS = Registry("reward", ("solution_str", "ground_truth", "extra"))
BATCH_REWARDS = Registry("batch reward", ("solution_strs", "ground_truths", "extras"))

DATA_SOURCE_ALIASES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "countdown": "countdown",
    "arithmetic": "arithmetic",
}
"""data_source values seen in public datasets -> registered reward name."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; a second, different fn under the same name fails."""
    return REWARDS.register(name)


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return REWARDS.names()


def get_reward_fn(name: str) -> RewardFn:
    """Resolve a registered name, a known data_source, `pkg.module:fn`, or `path/to/file.py:fn`."""
    return REWARDS.get(DATA_SOURCE_ALIASES.get(name, name))


def register_batch_reward(name: str) -> Callable:
    """Decorator registering a batch-level reward fn (see the module docstring) under `name`."""
    return BATCH_REWARDS.register(name)


def get_batch_reward_fn(name: str) -> Callable:
    """Resolve a registered batch reward name, `pkg.module:fn`, or `path/to/file.py:fn`."""
    return BATCH_REWARDS.get(name)


def normalize_result(result: Any) -> dict[str, Any]:
    """A reward fn's return value as a dict with a float `score` (bool/int/float or dict accepted)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward fn returned a dict without 'score': keys {sorted(result)}")
        return {**result, "score": float(result["score"])}
    if isinstance(result, (bool, int, float)):
        return {"score": float(result)}
    raise TypeError(f"reward fn must return a float or a dict with 'score', got {type(result).__name__}")
