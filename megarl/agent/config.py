"""`AgentConfig`: every knob of the agent loops (the run config hangs it under `rollout.agent`).

Imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class AgentConfig:
    """How agent loops turn a dataset row into a trajectory."""

    default_agent: str = "single_turn"
    """Agent loop for rows without an `agent_name` column (registered name or `pkg.module:fn`)."""
    max_response_tokens: int = 1024
    """Budget of response tokens per trajectory, model and observation tokens together."""
    max_assistant_turns: int = 8
    """Model turns per trajectory; the loop stops with finish reason max_turns after this many."""
    max_user_turns: int = 8
    """Environment (user) answers per trajectory in the environment loop; then max_turns."""
    max_parallel_calls: int = 4
    """Tool calls run per assistant turn; further calls of the turn get an error observation."""
    max_tool_calls: int = 32
    """Tool calls per trajectory; a turn that would pass it ends the loop with finish reason tool_budget."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this many tokens is cut (and counted as too_long)."""
    tool_response_truncate_side: str = "right"
    """Which part of an over-long tool result is dropped: right (keep the head), left (keep the tail), middle."""
    max_tool_output_chars: int = 65536
    """Tool output beyond this many characters is dropped before tokenizing (a tool that returns megabytes)."""
    tool_timeout_s: float = 10.0
    """Per-call time limit; a call past it yields a timeout observation."""
    tool_parser: str = "hermes"
    """How tool calls are read from the model's text (`megarl.agent.parsers.TOOL_PARSERS`)."""
    tool_config: Optional[str] = None
    """YAML file declaring the tools (OpenAI function schemas + tool types); None: no tools."""
    environment: str = "guess_number"
    """Environment of the `env` loop (`megarl.agent.env_loop.ENVIRONMENTS` or `pkg.module:Class`)."""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (on top of the row's `extra_info.env`)."""
    openai_agent: Optional[str] = None
    """User agent code for the `openai` loop: `pkg.module:fn` or `file.py:fn`, called as
    `await fn(client, sample)` with an `openai.AsyncOpenAI` client bound to the run's endpoint."""
    turn_seed_stride: int = 1_000_003
    """Seeded sampling: turn t of a trajectory uses seed + t * stride (turn 0 uses the row's seed)."""

    def __post_init__(self):
        for name in (
            "max_response_tokens",
            "max_assistant_turns",
            "max_parallel_calls",
            "max_tool_response_tokens",
            "max_tool_output_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_user_turns", "max_tool_calls"):
            if getattr(self, name) < 0:
                raise ValueError(f"AgentConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"AgentConfig.tool_response_truncate_side must be one of {TRUNCATE_SIDES},"
                f" got {self.tool_response_truncate_side!r}"
            )
        if self.tool_timeout_s <= 0:
            raise ValueError(f"AgentConfig.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
