"""Checks of the optional run modes, called by `validate` before any worker starts: asynchronous
training (`trainer.mode`, `async_training`) and agent loops (`rollout.agent`). Imports no megatron,
vLLM or Ray (the agent registries are looked up lazily).
"""

from __future__ import annotations

import os

from megarl.config.loader import ConfigError
from megarl.config.schema import ON_UPDATE, OVER_STALE, TRAINER_MODES, RunConfig


def check_async(cfg: RunConfig) -> None:
    """trainer.mode and async_training; async needs engines on their own pool and no per-step generation loop."""
    asy, mode = cfg.async_training, cfg.trainer.mode
    rules = [
        (mode in TRAINER_MODES, f"trainer.mode={mode!r}; pick one of {', '.join(TRAINER_MODES)}"),
        (asy.max_staleness >= 0, f"async_training.max_staleness={asy.max_staleness} must be >= 0 (0: synchronous)"),
        (asy.over_stale in OVER_STALE, f"async_training.over_stale={asy.over_stale!r}; pick one of pace, drop"),
        (asy.on_update in ON_UPDATE, f"async_training.on_update={asy.on_update!r}; pick one of continue, abort"),
        (
            asy.max_concurrent_rollouts is None or asy.max_concurrent_rollouts >= cfg.rollout.samples_per_prompt,
            f"async_training.max_concurrent_rollouts={asy.max_concurrent_rollouts} is below one prompt's"
            f" rollout.samples_per_prompt={cfg.rollout.samples_per_prompt}; raise it or leave it unset (null)",
        ),
    ]
    if mode == "async":
        rules += [
            (
                cfg.rollout.mode == "server",
                "trainer.mode=async overlaps generation with training, which colocated engines cannot (they share"
                " the actor's GPUs); set rollout.mode=server with rollout.pool=<a pool of its own in"
                " resources.pools>, or trainer.mode=sync",
            ),
            (
                not cfg.algorithm.dapo.filter_groups,
                "trainer.mode=async does not support"
                " algorithm.dapo.filter_groups yet; turn it off or use trainer.mode=sync",
            ),
            (
                cfg.algorithm.advantage.estimator != "remax",
                "trainer.mode=async does not support"
                " algorithm.advantage.estimator=remax (greedy baselines per step) yet; use trainer.mode=sync",
            ),
        ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def check_agent(cfg: RunConfig, check_paths: bool) -> None:
    """rollout.agent: names that exist, one response budget, the tool YAML present."""
    from megarl.agent import ENVIRONMENTS, TOOL_PARSERS, get_agent_loop

    agent, default = cfg.rollout.agent, type(cfg.rollout.agent)()
    if agent.max_response_tokens not in (default.max_response_tokens, cfg.rollout.max_response_tokens):
        raise ConfigError(
            f"rollout.agent.max_response_tokens={agent.max_response_tokens}: a trajectory's response"
            " budget is rollout.max_response_tokens (the training rows' width); set that instead"
        )
    for where, lookup, name in (
        ("rollout.agent.default_agent", get_agent_loop, agent.default_agent),
        ("rollout.agent.tool_parser", TOOL_PARSERS.get, agent.tool_parser),
        ("rollout.agent.environment", ENVIRONMENTS.get, agent.environment),
    ):
        try:
            lookup(name)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {err}") from None
    if check_paths and agent.tool_config is not None and not os.path.isfile(agent.tool_config):
        raise ConfigError(
            f"rollout.agent.tool_config: {agent.tool_config!r} does not exist (cwd {os.getcwd()});"
            " point it at the YAML file declaring the tools"
        )


__all__ = ["check_agent", "check_async"]
