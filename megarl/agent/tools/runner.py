"""Run one assistant turn's tool calls: concurrently, each under a timeout, every failure an observation.

Owns `CallResult`, `ERROR_KINDS` and `run_calls`. A malformed call, an unknown tool, arguments that
fail the tool's JSON schema, a tool that raises, one that runs past `tool_timeout_s` and one that
returns more than `max_tool_response_tokens` all become a result whose text the model sees and whose
`error` kind the trajectory counts; nothing here raises because of a tool. Calls past
`max_parallel_calls` in one turn are not run (kind over_limit). Imports jsonschema.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.agent.config import AgentConfig
from megarl.agent.parsers import ToolCall
from megarl.agent.tools.base import ToolResult, ToolSession

ERROR_KINDS = ("malformed", "unknown", "bad_args", "raised", "timeout", "too_long", "over_limit")
TRUNCATION_MARK = "...(truncated)"


@dataclass
class CallResult:
    """What became of one call."""

    name: str
    """The function called ('' for a malformed call)."""
    id: str
    """The call id (OpenAI tool_call_id)."""
    text: str
    """The tool message content the model sees (an error message on failure)."""
    error: Optional[str] = None
    """One of ERROR_KINDS, or None when the tool ran and its output fit."""
    seconds: float = 0.0
    """Wall-clock seconds of the call."""
    reward: float = 0.0
    """The tool's step reward (ToolResult.reward)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The tool's own numbers (ToolResult.metrics)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.id,
            "text": self.text,
            "error": self.error,
            "seconds": round(self.seconds, 6),
            "reward": self.reward,
        }


async def run_calls(calls: list[ToolCall], session: ToolSession, config: AgentConfig, tokenizer) -> list[CallResult]:
    """Results in call order; at most `max_parallel_calls` run (concurrently), the rest get over_limit."""
    limit = config.max_parallel_calls
    results = list(await asyncio.gather(*(run_call(c, session, config) for c in calls[:limit])))
    results += [
        CallResult(c.name, c.id, f"Error: not run: at most {limit} tool calls are run per turn.", "over_limit")
        for c in calls[limit:]
    ]
    for result in results:
        fit_text(result, config, tokenizer)
    return results


async def run_call(call: ToolCall, session: ToolSession, config: AgentConfig) -> CallResult:
    """One call, never raising: the tool's output, or an error observation of one of ERROR_KINDS."""
    if call.error is not None:
        return CallResult(call.name, call.id, f"Error: malformed tool call: {call.error}.", "malformed")
    tool = session.tools.get(call.name)
    if tool is None:
        return CallResult(
            call.name,
            call.id,
            f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(session.tools)) or 'none'}.",
            "unknown",
        )
    problem = argument_error(call.arguments, tool.parameters)
    if problem is not None:
        return CallResult(call.name, call.id, f"Error: bad arguments for {call.name}: {problem}.", "bad_args")
    start = time.monotonic()
    try:
        output = await asyncio.wait_for(session.execute(tool, call.arguments), config.tool_timeout_s)
    except asyncio.TimeoutError:
        return CallResult(
            call.name,
            call.id,
            f"Error: {call.name} timed out after {config.tool_timeout_s:g} s.",
            "timeout",
            time.monotonic() - start,
        )
    except Exception as exc:  # noqa: BLE001 - a tool that raises is an observation, never a crashed step
        return CallResult(
            call.name,
            call.id,
            f"Error: {call.name} raised {type(exc).__name__}: {exc}",
            "raised",
            time.monotonic() - start,
        )
    result = output if isinstance(output, ToolResult) else ToolResult(_as_text(output))
    return CallResult(
        call.name,
        call.id,
        _as_text(result.text),
        None,
        time.monotonic() - start,
        float(result.reward),
        dict(result.metrics),
    )


def argument_error(arguments: dict, parameters: dict) -> Optional[str]:
    """Why `arguments` fail the JSON schema `parameters` (None when they pass)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(parameters).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where + ': ' if where else ''}{error.message}"


def _as_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    try:
        return json.dumps(output, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(output)


def fit_text(result: CallResult, config: AgentConfig, tokenizer) -> None:
    """Cut an over-long result to `max_tool_response_tokens` (characters first, so megabytes never reach
    the tokenizer); marks it too_long unless it already failed."""
    text, side = result.text, config.tool_response_truncate_side
    cut = len(text) > config.max_tool_output_chars
    if cut:
        text = _cut(text, config.max_tool_output_chars, side)
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # may pass model_max_length: no warning
    if len(ids) > config.max_tool_response_tokens:
        mark = tokenizer.encode(TRUNCATION_MARK, add_special_tokens=False)
        keep = max(config.max_tool_response_tokens - len(mark), 0)
        text = tokenizer.decode(_cut(ids, keep, side, mark))
        cut = True
    if cut:
        result.text = text
        result.error = result.error or "too_long"


def _cut(seq, keep: int, side: str, mark=None):
    """`seq` shortened to `keep` items (+ the mark where the cut is); side: which part is dropped."""
    mark = mark if mark is not None else TRUNCATION_MARK
    if side == "right":
        return seq[:keep] + mark
    if side == "left":
        return mark + seq[len(seq) - keep :]
    head = keep // 2
    return seq[:head] + mark + seq[len(seq) - (keep - head) :]
