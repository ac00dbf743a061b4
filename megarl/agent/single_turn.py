"""The `single_turn` agent loop: one request, one completion: exactly today's single-turn rollout.

The prompt is the row's own tokens (`AgentSample.prompt_ids`, what the dataset rendered), the
params are the run's with the row's seed, and the completion's tokens, log-probs, version and
finish reason become the trajectory verbatim: the same tokens and log-probs as calling the engine
directly with the same seed. Imports the agent package's own modules only.
"""

from __future__ import annotations

import time

from megarl.agent.base import AgentContext, AgentLLM, AgentSample, register_agent_loop
from megarl.agent.chat import ChatRenderer
from megarl.agent.trajectory import Trajectory
from megarl.rollout.base import Completion


@register_agent_loop("single_turn")
async def single_turn(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory:
    """Generate once; finish reason stop or length, as the engine said."""
    prompt_ids = (
        sample.prompt_ids if sample.prompt_ids is not None else ChatRenderer(ctx.tokenizer).prompt_ids(sample.messages)
    )
    params = ctx.turn_params(sample, 0, min(ctx.params.max_tokens, ctx.config.max_response_tokens))
    start = time.monotonic()
    completion = await llm.generate(prompt_ids, params)
    return completion_trajectory(prompt_ids, completion, ctx.tokenizer, time.monotonic() - start)


def completion_trajectory(prompt_ids, completion: Completion, tokenizer=None, seconds: float = 0.0) -> Trajectory:
    """The single-turn trajectory of one engine completion (also what the trainer builds when it sends a
    batch of single-turn requests at once); its turn's text is decoded when a tokenizer is given."""
    trajectory = Trajectory(list(prompt_ids))
    trajectory.add_model_turn(
        completion.token_ids,
        completion.logprobs or [0.0] * len(completion.token_ids),
        completion.version,
        finish_reason=completion.finish_reason,
        text=tokenizer.decode(completion.token_ids, skip_special_tokens=True) if tokenizer else "",
        seconds=seconds,
        versions=completion.versions or None,
    )
    trajectory.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
    return trajectory.finalize()
