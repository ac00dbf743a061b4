"""`Conversation`: the bookkeeping every multi-turn loop shares (generate a turn, append an observation).

Owns `Conversation`: it holds the growing `Trajectory` and the chat messages beside it, asks the LLM
for the next turn within the response-token budget (turn t seeded as `AgentContext.turn_params`
says), decodes it, and appends observations as chat-template delta tokens (`ChatRenderer`).
Loops (`tool_agent`, `env_loop`) decide what to observe and when to stop; this class never does.
Imports the agent package's own modules only.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from megarl.agent.base import AgentContext, AgentLLM, AgentSample
from megarl.agent.chat import ChatRenderer
from megarl.agent.trajectory import Trajectory, Turn


class Conversation:
    """One trajectory being built turn by turn."""

    def __init__(self, sample: AgentSample, ctx: AgentContext, tools: Optional[Sequence[dict]] = None):
        self.sample, self.ctx, self.config = sample, ctx, ctx.config
        self.renderer = ChatRenderer(ctx.tokenizer, tools)
        self.messages = [dict(m) for m in sample.messages]
        if tools or sample.prompt_ids is None:
            prompt_ids = self.renderer.prompt_ids(self.messages)
        else:
            prompt_ids = list(sample.prompt_ids)
        self.trajectory = Trajectory(prompt_ids)
        self.last_model_ids: list[int] = []

    @property
    def budget(self) -> int:
        """Response tokens left."""
        return self.config.max_response_tokens - len(self.trajectory.response_ids)

    async def generate(self, llm: AgentLLM) -> Optional[Turn]:
        """The model's next turn (None when no response token is left)."""
        if self.budget <= 0:
            return None
        traj = self.trajectory
        params = self.ctx.turn_params(self.sample, traj.num_turns, self.budget)
        start = time.monotonic()
        completion = await llm.generate(traj.prompt_ids + traj.response_ids, params)
        if completion.logprobs is None:
            raise ValueError("agent loops need the engine's log-prob of every token: SamplingParams.logprobs=True")
        text = self.ctx.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        turn = traj.add_model_turn(
            completion.token_ids,
            completion.logprobs,
            completion.version,
            text=text,
            finish_reason=completion.finish_reason,
            seconds=time.monotonic() - start,
        )
        self.last_model_ids = list(completion.token_ids)
        self.messages.append({"role": "assistant", "content": text})
        return turn

    def observe(
        self, role: str, messages: list[dict], *, seconds: float = 0.0, tool_results: Optional[list[dict]] = None
    ) -> bool:
        """Append `messages` (tool / user turns) as template delta tokens; False (nothing appended) when
        they and at least one more model token do not fit the budget."""
        ids = self.renderer.observation_ids(self.last_model_ids, messages)
        if len(ids) >= self.budget:
            return False
        text = "\n".join(str(m.get("content", "")) for m in messages)
        self.trajectory.add_observation(role, ids, text=text, seconds=seconds, tool_results=tool_results)
        self.messages.extend(messages)
        return True

    def finish(self, reason: str, error: Optional[str] = None, **metrics: float) -> Trajectory:
        """Set the finish reason and the metrics; returns the checked trajectory."""
        self.trajectory.finish_reason = reason
        self.trajectory.error = error
        return self.trajectory.finalize(**metrics)
