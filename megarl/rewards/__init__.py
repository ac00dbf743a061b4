"""Rule-based rewards: the registry, the built-in reward fns, the pooled runner and the sandbox.

Every reward fn has one signature, `fn(solution_str, ground_truth, extra) -> float | dict`
(see `registry`); batch-level reward fns get the whole step, `fn(solution_strs, ground_truths,
extras) -> list` (e.g. a judge model or a remote service; `RewardConfig.batch_reward_fn`).
Built-ins: `gsm8k`, `gsm8k_flexible`, `math`, `arithmetic`, `countdown`, `code`.
`RewardRunner` scores a step's samples in a process pool with per-sample timeouts; `sandbox`
runs model-written code. Model-based rewards live with the reward role, not here.
Must not import torch, megatron, vLLM or Ray.
"""

from megarl.rewards import code_exec, gsm8k, math_answer, tasks  # noqa: F401 -- register built-ins
from megarl.rewards.registry import (
    BATCH_REWARDS,
    DATA_SOURCE_ALIASES,
    RewardFn,
    get_batch_reward_fn,
    get_reward_fn,
    list_rewards,
    normalize_result,
    register_batch_reward,
    register_reward,
)
from megarl.rewards.runner import RewardConfig, RewardRunner

__all__ = [
    "BATCH_REWARDS",
    "DATA_SOURCE_ALIASES",
    "RewardConfig",
    "RewardFn",
    "RewardRunner",
    "get_batch_reward_fn",
    "get_reward_fn",
    "list_rewards",
    "normalize_result",
    "register_batch_reward",
    "register_reward",
]
