"""Agent loops: turn one dataset row into a multi-turn trajectory of exact engine tokens.

The contract (`base`): an agent loop is

    @register_agent_loop("name")
    async def loop(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory

registered by name (one signature, like the other registries); a row's `agent_name` column picks
it (default `AgentConfig.default_agent`, `single_turn`). The loop generates through `llm`
(`await llm.generate(prompt_ids, params)` → one `Completion`; the client carries a session id so
the trainer's manager can keep a conversation on one engine) and returns a `Trajectory`: prompt
ids, response ids, a response mask (1 = model token, 0 = tool / user / environment token), the
rollout log-prob and policy version of every model token, per-turn records, the number of turns, a
finish reason (stop, length, max_turns, tool_budget, error), per-turn rewards and reward extras.
Token-in, token-out: model tokens are the engine's verbatim; everything else is chat-template delta
tokens (`chat.ChatRenderer`); nothing is re-tokenized from text.

Built-in loops: `single_turn` (today's rollout, exactly), `tool_agent` (tools from a YAML of
OpenAI function schemas, parsers by name: hermes, pythonic, mistral), `env` (an environment answers
every turn; per-turn rewards), `openai` (user agent code written against the `openai` client,
recorded through `openai_server.ChatServer`). Config: `megarl.agent.config.AgentConfig`.

Imports torch (the rollout contract) and the standard library at import time; bm25s, jsonschema,
FastAPI / uvicorn and openai only where used. Never imports megatron, vLLM or Ray, nor the trainer.
"""

from megarl.agent import env_loop, openai_agent, single_turn, tool_agent  # noqa: F401 - register the loops
from megarl.agent.base import (
    AGENT_LOOPS,
    AgentContext,
    AgentLLM,
    AgentSample,
    EngineLLM,
    get_agent_loop,
    register_agent_loop,
    run_agent,
    run_agents,
)
from megarl.agent.config import AgentConfig
from megarl.agent.env_loop import ENVIRONMENTS, Environment, StepResult
from megarl.agent.parsers import TOOL_PARSERS, Parsed, ToolCall
from megarl.agent.replay import ReplayLLM
from megarl.agent.tools import TOOLS, Tool, ToolResult, ToolSet
from megarl.agent.trajectory import FINISH_REASONS, Trajectory, Turn, summarize

__all__ = [
    "AGENT_LOOPS",
    "AgentConfig",
    "AgentContext",
    "AgentLLM",
    "AgentSample",
    "ENVIRONMENTS",
    "EngineLLM",
    "Environment",
    "FINISH_REASONS",
    "Parsed",
    "ReplayLLM",
    "StepResult",
    "TOOLS",
    "TOOL_PARSERS",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "Trajectory",
    "Turn",
    "get_agent_loop",
    "register_agent_loop",
    "run_agent",
    "run_agents",
    "summarize",
]
