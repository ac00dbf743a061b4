"""The reward-function registry: one signature for every rule reward, lookup by name or path.

Every reward function has the signature

    fn(solution_str: str, ground_truth: str, extra: dict) -> float | dict

`solution_str` is the decoded response, `ground_truth` the dataset's ground-truth string and
`extra` the row's other columns (data_source, extra_info, ...). A dict result must hold `score`;
its other numeric entries (e.g. `acc`) are logged as metrics. `get_reward_fn` accepts a registered
name, `pkg.module:fn`, or `path/to/file.py:fn` (user code). Imports nothing heavy.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

RewardFn = Callable[[str, str, dict], "float | dict[str, Any]"]

_REGISTRY: dict[str, RewardFn] = {}

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

    def decorator(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        if old is not None and _qualname(old) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered to {_qualname(old)}; pick another name")
        _REGISTRY[name] = fn
        return fn

    return decorator


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """Resolve a registered name, `pkg.module:fn`, or `path/to/file.py:fn` to a reward function."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in DATA_SOURCE_ALIASES:
        return _REGISTRY[DATA_SOURCE_ALIASES[name]]
    if ":" in name:
        return _load_dotted(name)
    raise ValueError(
        f"unknown reward {name!r}; registered rewards: {list_rewards()} "
        "(or give 'pkg.module:fn' / 'path/to/file.py:fn')"
    )


def _load_dotted(spec: str) -> RewardFn:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        module = _load_file(target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"reward {spec!r}: cannot import module {target!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {target!r} has no callable {attr!r}")
    return fn


def _load_file(path: str):
    if not os.path.isfile(path):
        raise ValueError(f"reward file {path!r} does not exist (cwd {os.getcwd()})")
    name = "megarl_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so process pools can pickle its functions by reference
    spec.loader.exec_module(module)
    return module


def normalize_result(result: Any) -> dict[str, Any]:
    """A reward fn's return value as a dict with a float `score` (bool/int/float or dict accepted)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward fn returned a dict without 'score': keys {sorted(result)}")
        return {**result, "score": float(result["score"])}
    if isinstance(result, (bool, int, float)):
        return {"score": float(result)}
    raise TypeError(f"reward fn must return a float or a dict with 'score', got {type(result).__name__}")


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
