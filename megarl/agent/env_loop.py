"""The `env` loop: an environment answers every assistant turn (user simulators, games).

Owns `Environment` (subclass it), `StepResult`, the registry `ENVIRONMENTS` (built per trajectory as
`cls(sample, **kwargs)`, kwargs = `AgentConfig.environment_kwargs` updated by the row's
`extra_info['env']`; the row's `extra_info['environment']` overrides `AgentConfig.environment`),
the loop, and `GuessNumber`, a tiny built-in game.

Each round: the model's turn → `env.step(messages)` → (observation, reward, done). The reward is
that turn's reward: it lands on the turn's last model token (`Trajectory.turn_rewards`), so
per-turn and per-trajectory rewards (the row's reward function, on the final text) both reach the
advantage estimator. The observation is appended as a user turn (template delta tokens, mask 0).
Finish reasons: stop (done, or no observation), max_turns (`max_assistant_turns` model turns or
`max_user_turns` answers), length (budget), error (the environment raised or ran past
`tool_timeout_s`). Imports the agent package's own modules only.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Optional

from megarl.agent.base import ENVIRONMENTS, AgentContext, AgentLLM, AgentSample, register_agent_loop
from megarl.agent.conversation import Conversation
from megarl.agent.tools.base import call_maybe_async
from megarl.agent.trajectory import Trajectory


@dataclass
class StepResult:
    """An environment's answer to one assistant turn."""

    observation: Optional[str]
    """The next user message (None: the conversation ends)."""
    reward: float = 0.0
    """This turn's reward."""
    done: bool = False
    """True: the episode is over (the loop stops after this turn)."""


class Environment:
    """Answers assistant turns; one instance per trajectory. `step` may be async or plain."""

    def __init__(self, sample: AgentSample, **kwargs):
        self.sample = sample

    def step(self, messages: list[dict]) -> StepResult | tuple:
        """`messages`: the whole conversation so far, the model's latest turn last."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(messages)")

    def close(self) -> None:
        """Free the episode's resources."""


@ENVIRONMENTS.register("guess_number")
class GuessNumber(Environment):
    """Guess a secret integer in [low, high]; the answer says higher / lower. Reward 1 for the right
    number; `invalid_reward` for a turn without a number. The secret is the row's ground truth (or `secret`)."""

    def __init__(
        self,
        sample: AgentSample,
        *,
        low: int = 1,
        high: int = 100,
        secret: Optional[int] = None,
        invalid_reward: float = -0.1,
    ):
        super().__init__(sample)
        self.low, self.high, self.invalid_reward = low, high, invalid_reward
        self.secret = int(secret if secret is not None else sample.ground_truth)

    def step(self, messages: list[dict]) -> StepResult:
        numbers = re.findall(r"-?\d+", messages[-1]["content"])
        if not numbers:
            return StepResult(f"Answer with one number between {self.low} and {self.high}.", self.invalid_reward)
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult("Correct!", 1.0, done=True)
        return StepResult("Higher." if guess < self.secret else "Lower.", 0.0)


def build_environment(sample: AgentSample, ctx: AgentContext) -> Environment:
    """The row's environment, with the config's kwargs updated by the row's `extra_info['env']`."""
    name = sample.extra_info.get("environment") or ctx.config.environment
    kwargs = {**ctx.config.environment_kwargs, **(sample.extra_info.get("env") or {})}
    cls = ENVIRONMENTS.get(name)
    try:
        return cls(sample, **kwargs)
    except TypeError as err:
        raise ValueError(f"cannot build environment {name!r} with {kwargs}: {err}") from None


async def _step(env: Environment, messages: list[dict], timeout_s: float) -> StepResult:
    result = await asyncio.wait_for(call_maybe_async(env.step, messages), timeout_s)
    if isinstance(result, tuple):
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise TypeError(
            f"{type(env).__name__}.step must return StepResult or (observation, reward, done),"
            f" got {type(result).__name__}"
        )
    return result


@register_agent_loop("env", "interaction")
async def env_loop(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory:
    """Alternate model turns and environment answers until done or a limit."""
    env = build_environment(sample, ctx)
    conv = Conversation(sample, ctx)
    totals = {"env_return": 0.0, "env_done": False, "env_seconds": 0.0}
    try:
        reason, error = await _rounds(conv, llm, ctx, env, totals)
    finally:
        await call_maybe_async(env.close)
    conv.trajectory.reward_extras.update(totals)
    return conv.finish(reason, error, env_return=totals["env_return"], env_seconds=totals["env_seconds"])


async def _rounds(conv: Conversation, llm: AgentLLM, ctx: AgentContext, env: Environment, totals: dict):
    """(finish reason, error text) once the episode or a limit ends it."""
    cfg, user_turns = ctx.config, 0
    while True:
        turn = await conv.generate(llm)
        if turn is None or turn.finish_reason == "length":
            return "length", None
        start = time.monotonic()
        try:
            result = await _step(env, conv.messages, cfg.tool_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the trajectory so far is kept, marked error
            return "error", f"environment step failed: {type(exc).__name__}: {exc}"
        finally:
            totals["env_seconds"] += time.monotonic() - start
        conv.trajectory.reward_turn(result.reward, turn)
        totals["env_return"] += result.reward
        if result.done or result.observation is None:
            totals["env_done"] = bool(result.done)
            return "stop", None
        if conv.trajectory.num_turns >= cfg.max_assistant_turns or user_turns >= cfg.max_user_turns:
            return "max_turns", None
        if not conv.observe(
            "user", [{"role": "user", "content": result.observation}], seconds=time.monotonic() - start
        ):
            return "length", None
        user_turns += 1
