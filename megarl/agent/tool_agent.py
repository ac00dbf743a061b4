"""The `tool_agent` loop: render tools into the prompt, generate, parse calls, run them, append, repeat.

Owns the loop and its per-trajectory tool metrics. Each round: the model's turn (within the
response-token budget) → `ctx.parser` reads its tool calls → none: finish `stop`; otherwise the
calls run concurrently (`tools.runner.run_calls`: timeouts, schema checks, truncation, every failure
an error observation) and their results are appended as one tool turn of template delta tokens.
Stops with `length` (budget spent or a turn cut by max_tokens), `max_turns`
(`max_assistant_turns` model turns and still calling), `tool_budget` (the turn's calls would pass
`max_tool_calls`). Tool step rewards land on the calling turn; `Tool.reward` per trajectory goes to
`reward_extras['tool_rewards']`, and the last assistant turn's text without tool-call markup to
`reward_extras['final_response']` (the answer, for rewards that must not read the tools' output). Imports the agent package's own modules only.
"""

from __future__ import annotations

import time
from collections import Counter

from megarl.agent.base import AgentContext, AgentLLM, AgentSample, register_agent_loop
from megarl.agent.conversation import Conversation
from megarl.agent.tools.runner import ERROR_KINDS, CallResult, run_calls
from megarl.agent.trajectory import Trajectory


class ToolStats:
    """Counts of one trajectory's calls, errors by kind, and seconds spent in tools; `tool_success` is 1
    when at least one call ran without error (its step mean: the share of trajectories that used a tool)."""

    def __init__(self):
        self.calls = 0
        self.successes = 0
        self.seconds = 0.0
        self.errors: Counter = Counter()

    def add(self, results: list[CallResult], seconds: float) -> None:
        self.calls += len(results)
        self.successes += sum(not r.error for r in results)
        self.seconds += seconds
        self.errors.update(r.error for r in results if r.error)

    def metrics(self) -> dict[str, float]:
        out = {
            "tool_calls": self.calls,
            "tool_errors": sum(self.errors.values()),
            "tool_seconds": self.seconds,
            "tool_success": float(self.successes > 0),
        }
        out.update({f"tool_errors/{kind}": self.errors[kind] for kind in ERROR_KINDS})
        return out


@register_agent_loop("tool_agent")
async def tool_agent(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory:
    """Multi-turn tool calling until the model stops calling or a limit is reached."""
    if ctx.toolset is None:
        raise ValueError(
            "the tool_agent loop needs tools: set AgentConfig.tool_config to a tool YAML (rollout.agent.tool_config)"
        )
    schemas = ctx.toolset.schemas(sample.tools)
    conv = Conversation(sample, ctx, schemas)
    session = ctx.toolset.session(sample, sample.tools)
    stats = ToolStats()
    try:
        reason = await _rounds(conv, llm, ctx, session, stats)
    finally:
        conv.trajectory.reward_extras["tool_rewards"] = await session.close()
        conv.trajectory.reward_extras["final_response"] = _final_response(conv.trajectory, ctx)
    if session.close_errors:
        conv.trajectory.reward_extras["tool_close_errors"] = session.close_errors
    return conv.finish(reason, **stats.metrics(), tool_close_errors=len(session.close_errors))


async def _rounds(conv: Conversation, llm: AgentLLM, ctx: AgentContext, session, stats: ToolStats) -> str:
    """Generate and run tools until done; returns the finish reason."""
    cfg = ctx.config
    while True:
        turn = await conv.generate(llm)
        if turn is None or turn.finish_reason == "length":
            return "length"
        parsed = ctx.parser(turn.text)
        for i, call in enumerate(parsed.calls):
            call.id = call.id or f"call_{conv.trajectory.num_turns - 1}_{i}"
        turn.tool_calls = [c.to_dict() for c in parsed.calls]
        if not parsed.calls:
            return "stop"
        conv.messages[-1].update(content=parsed.content, tool_calls=_openai_calls(parsed.calls))
        if conv.trajectory.num_turns >= cfg.max_assistant_turns:
            return "max_turns"
        if stats.calls + min(len(parsed.calls), cfg.max_parallel_calls) > cfg.max_tool_calls:
            return "tool_budget"
        start = time.monotonic()
        results = await run_calls(parsed.calls, session, cfg, ctx.tokenizer)
        stats.add(results, time.monotonic() - start)
        step_reward = sum(r.reward for r in results)
        if step_reward:
            conv.trajectory.reward_turn(step_reward, turn)
        messages = [{"role": "tool", "content": r.text, "tool_call_id": r.id, "name": r.name} for r in results]
        if not conv.observe(
            "tool", messages, seconds=time.monotonic() - start, tool_results=[r.to_dict() for r in results]
        ):
            return "length"


def _final_response(trajectory: Trajectory, ctx: AgentContext) -> str:
    """The last assistant turn's text without its tool-call markup ('' when the model never spoke)."""
    last = next((t for t in reversed(trajectory.turns) if t.role == "assistant"), None)
    return ctx.parser(last.text).content if last is not None else ""


def _openai_calls(calls) -> list[dict]:
    import json

    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ]
