"""The agent-loop contract: the sample, the LLM client, the run context, the registry, `run_agent`.

Owns:
    AgentSample    one dataset row as an agent loop sees it (messages, prompt ids, ground truth, ...)
    AgentLLM       the client a loop generates through: `await llm.generate(prompt_ids, params)` → ONE
                   `Completion`; it carries a `session_id` so every turn of a conversation can be routed to
                   the same engine (prefix cache). `EngineLLM` is the plain client over one engine.
    AgentContext   what every loop of a run shares: tokenizer, base sampling params, `AgentConfig`, tools
    AGENT_LOOPS    loops by name, one signature: `async def loop(sample, llm, ctx) -> Trajectory`
    run_agent      pick the loop by the row's `agent_name` (default `ctx.config.default_agent`), run it,
                   check what it returns

Imports the rollout contract (`megarl.rollout.base`: torch) and the standard library; no vLLM, Ray
or megatron.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from megarl.agent.config import AgentConfig
from megarl.agent.trajectory import Trajectory
from megarl.rollout.base import Completion, SamplingParams
from megarl.utils.registry import Registry

AGENT_LOOPS = Registry("agent loop", ("sample", "llm", "ctx"))
"""`async def loop(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory`."""
ENVIRONMENTS = Registry("environment", ("sample",))
"""Environment classes by name (`megarl.agent.env_loop`); `pkg.module:Class` or `file.py:Class` loads a user's."""
OPENAI_AGENTS = Registry("openai agent", ("client", "sample"))
"""User agent functions written against the `openai` client, by name (`megarl.agent.openai_agent`);
`pkg.module:fn` or `file.py:fn` loads one."""

_ROW_FIELDS = (
    "input_ids",
    "raw_prompt",
    "ground_truth",
    "data_source",
    "extra_info",
    "agent_name",
    "tools",
    "dataset_index",
    "seed",
)


@dataclass
class AgentSample:
    """One dataset row, as an agent loop sees it."""

    messages: list[dict]
    """The prompt as chat messages (a string prompt becomes one user message)."""
    prompt_ids: Optional[list[int]] = None
    """The dataset's tokenized prompt (chat template, no tools); loops with tools render their own."""
    ground_truth: Any = None
    """The reference answer the reward compares with."""
    data_source: str = "unknown"
    """Which reward function scores the row."""
    extra_info: dict = field(default_factory=dict)
    """The row's extras (environment settings under `env`, tool settings, ...)."""
    agent_name: Optional[str] = None
    """The agent loop for this row (None: `AgentConfig.default_agent`)."""
    tools: Optional[list[str]] = None
    """Names of the tools this row may use (None: every tool of the tool config)."""
    seed: Optional[int] = None
    """Sampling seed of the first turn (None: the base params' seed)."""
    index: Any = None
    """The row's dataset index (for logs)."""
    extra: dict = field(default_factory=dict)
    """Every other column of the row."""

    @classmethod
    def from_row(cls, row: dict, *, seed: Optional[int] = None) -> "AgentSample":
        """From a dataset item / batch row: input_ids, raw_prompt, ground_truth, data_source, extra_info,
        agent_name, tools (a list of names or one comma-separated string), plus pass-through columns."""
        if "raw_prompt" not in row and "messages" not in row:
            raise ValueError(f"an agent sample needs 'raw_prompt' (or 'messages'); the row has {sorted(row)}")
        prompt = row.get("raw_prompt", row.get("messages"))
        ids = row.get("input_ids")
        tools = row.get("tools")
        return cls(
            messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt],
            prompt_ids=None if ids is None else [int(t) for t in ids],
            ground_truth=row.get("ground_truth"),
            data_source=row.get("data_source") or "unknown",
            extra_info=dict(row.get("extra_info") or {}),
            agent_name=row.get("agent_name") or None,
            tools=[t.strip() for t in tools.split(",") if t.strip()]
            if isinstance(tools, str)
            else ([str(t) for t in tools] if tools is not None else None),
            seed=row.get("seed", seed),
            index=row.get("dataset_index"),
            extra={k: v for k, v in row.items() if k not in _ROW_FIELDS and k != "messages"},
        )


class AgentLLM(Protocol):
    """What an agent loop generates through (the trainer's manager routes it over the engines)."""

    session_id: str

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """ONE completion of `prompt_ids` (params.n is ignored)."""


class EngineLLM:
    """`AgentLLM` over one rollout engine (every session on it)."""

    def __init__(self, engine, session_id: Optional[str] = None):
        self.engine = engine
        self.session_id = session_id or uuid.uuid4().hex

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        completions = await self.engine.generate(list(prompt_ids), dataclasses.replace(params, n=1))
        return completions[0]


@dataclass
class AgentContext:
    """What every agent loop of a run shares."""

    tokenizer: Any
    """The policy's HF tokenizer (chat template, decoding)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Base sampling params of every turn (max_tokens: a turn's limit; n is ignored)."""
    config: AgentConfig = field(default_factory=AgentConfig)
    """Loop limits, tool parser, tool config, environment."""
    toolset: Any = None
    """The run's `ToolSet`; None: built from `config.tool_config` (no tools when that is None too)."""

    def __post_init__(self):
        from megarl.agent.parsers import get_parser

        # unknown names fail here, before any work
        self.parser = get_parser(self.config.tool_parser)
        get_agent_loop(self.config.default_agent)  # imports megarl.agent: every built-in is registered
        ENVIRONMENTS.get(self.config.environment)
        if self.config.openai_agent:
            OPENAI_AGENTS.get(self.config.openai_agent)
        if self.toolset is None and self.config.tool_config is not None:
            from megarl.agent.tools import ToolSet

            self.toolset = ToolSet.from_yaml(self.config.tool_config)

    def close(self) -> None:
        """Stop what the context started (the chat endpoint of the `openai` loop)."""
        server = getattr(self, "_chat_server", None)
        if server is not None:
            server.stop()
            self._chat_server = None

    def turn_params(self, sample: AgentSample, turn: int, max_tokens: int) -> SamplingParams:
        """Turn `turn`'s params: at most `max_tokens`, n=1, seed + turn * stride when seeded."""
        base = sample.seed if sample.seed is not None else self.params.seed
        seed = None if base is None else base + turn * self.config.turn_seed_stride
        return dataclasses.replace(
            self.params, n=1, max_tokens=max(1, min(self.params.max_tokens, max_tokens)), seed=seed
        )


def register_agent_loop(*names: str) -> Callable:
    """Decorator: `@register_agent_loop("my_loop")` on `async def loop(sample, llm, ctx) -> Trajectory`."""
    return AGENT_LOOPS.register(*names)


def get_agent_loop(name: str) -> Callable:
    """The loop registered as `name` (or at `pkg.module:fn`); unknown names list the valid ones."""
    import megarl.agent  # noqa: F401 - registers the built-in loops

    return AGENT_LOOPS.get(name)


async def run_agent(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory:
    """Run the row's agent loop and check its trajectory."""
    name = sample.agent_name or ctx.config.default_agent
    trajectory = await get_agent_loop(name)(sample, llm, ctx)
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"agent loop {name!r} returned {type(trajectory).__name__}, not a Trajectory")
    return trajectory.check()


async def run_agents(samples: Sequence[AgentSample], engine, ctx: AgentContext) -> list[Trajectory]:
    """Every sample's trajectory, concurrently, over one engine (a session per sample)."""
    return list(await asyncio.gather(*(run_agent(s, EngineLLM(engine), ctx) for s in samples)))
