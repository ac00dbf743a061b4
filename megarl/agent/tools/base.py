"""The tool contract, the tool registry, YAML loading and the per-trajectory tool lifecycle.

Owns `Tool` (subclass it), `ToolResult`, the registry `TOOLS` (every tool class is built as
`cls(schema, **config)`), `ToolSet` (the run's tools, from a YAML file of OpenAI function schemas)
and `ToolSession` (one trajectory's tool states: create → execute → reward → release).

A tool's methods may be `async def` or plain `def`; plain ones run in a daemon thread so a slow
tool does not stall the event loop (and a hung one cannot block the process from exiting).
Imports pyyaml and jsonschema; no torch, vLLM or Ray.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from megarl.utils.registry import Registry

TOOLS = Registry("tool", ("schema",))
"""Tool classes by name; `pkg.module:Class` or `file.py:Class` loads a user's tool."""


@dataclass
class ToolResult:
    """What one call returns: the text the model sees, plus an optional step reward and metrics."""

    text: str
    """Shown to the model as the tool message's content."""
    reward: float = 0.0
    """A reward for this call (summed into the trajectory's `reward_extras['tool_step_reward']`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to log (summed per trajectory as `tool/<name>/<key>`)."""


class Tool:
    """One kind of tool, built once per run; per-trajectory state comes from `create`.

    Override `execute` (and `default_schema`, the OpenAI function schema used when the YAML gives
    none); override `create` / `reward` / `release` for tools with per-trajectory state (a sandbox,
    a game, a counter). `execute` returns a `ToolResult`, a string, or anything JSON-serialisable.
    """

    default_schema: ClassVar[Optional[dict]] = None

    def __init__(self, schema: Optional[dict] = None, **config: Any):
        schema = copy.deepcopy(schema or self.default_schema)
        if schema is None:
            raise ValueError(
                f"tool {type(self).__name__} has no default schema; give one under 'schema' in the tool YAML"
            )
        self.schema = check_schema(schema, type(self).__name__)
        self.config = config

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}

    async def create(self, sample) -> Any:
        """Per-trajectory state (called before the trajectory's first call of this tool)."""
        return None

    def execute(self, state: Any, arguments: dict) -> ToolResult | str | Any:
        raise NotImplementedError(f"{type(self).__name__} must implement execute(state, arguments)")

    async def reward(self, state: Any) -> Optional[float]:
        """A per-trajectory reward from this tool's state (None: none)."""
        return None

    async def release(self, state: Any) -> None:
        """Free the trajectory's state."""


def check_schema(schema: dict, where: str) -> dict:
    """An OpenAI function schema {type: function, function: {name, description, parameters}}, checked."""
    import jsonschema

    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
        raise ValueError(
            f"{where}: a tool schema must be {{'type': 'function', 'function': {{'name': ...,"
            f" 'parameters': {{...}}}}}} (OpenAI function format), got {schema!r}"
        )
    schema.setdefault("type", "function")
    name = schema["function"].get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where}: tool schema needs function.name, an identifier; got {name!r}")
    params = schema["function"].get("parameters")
    if params is not None:
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as err:
            raise ValueError(
                f"{where}: function {name!r} has an invalid parameters JSON schema: {err.message}"
            ) from None
    return schema


async def call_maybe_async(fn, *args):
    """Await `fn(*args)` if it is a coroutine function, else run it in a daemon thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target():
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop closed while a timed-out call was still running: nobody waits
            pass

    threading.Thread(target=target, daemon=True, name=f"megarl-tool-{getattr(fn, '__qualname__', 'fn')}").start()
    return await future


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ToolSet:
    """The run's tools by function name."""

    def __init__(self, tools: list[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; function names must be unique")
            self.tools[tool.name] = tool

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ToolSet":
        """Tools declared in a YAML file (see `load_tool_entries`)."""
        return cls([build_tool(entry, f"{path} tools[{i}]") for i, entry in enumerate(load_tool_entries(path))])

    def names(self) -> list[str]:
        return sorted(self.tools)

    def schemas(self, names: Optional[list[str]] = None) -> list[dict]:
        """OpenAI schemas of `names` (all tools when None), for `apply_chat_template(tools=...)`."""
        if names is None:
            return [t.schema for t in self.tools.values()]
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise ValueError(
                f"row asks for tools {unknown} that the tool config does not declare; declared: {self.names()}"
            )
        return [self.tools[n].schema for n in names]

    def session(self, sample, names: Optional[list[str]] = None) -> "ToolSession":
        """A trajectory's view of the tools (`names` only, when given)."""
        tools = self.tools if names is None else {n: self.tools[n] for n in names}
        return ToolSession(tools, sample)


def load_tool_entries(path: str | Path) -> list[dict]:
    """The `tools:` list of a tool YAML, each entry {type, config?, schema?}; bad files fail naming the fix."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tool config {str(path)!r} does not exist (AgentConfig.tool_config)")
    data = yaml.safe_load(path.read_text()) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            f"{path}: a tool config needs a non-empty list under 'tools:', each entry"
            " {type: <registered tool or pkg.module:Class>, config: {...}, schema: {...}}"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "type" not in entry:
            raise ValueError(
                f"{path} tools[{i}]: each tool needs 'type' (one of {TOOLS.names()} or"
                f" 'pkg.module:Class'), got {entry!r}"
            )
        extra = set(entry) - {"type", "config", "schema"}
        if extra:
            raise ValueError(f"{path} tools[{i}]: unknown keys {sorted(extra)}; allowed: type, config, schema")
    return entries


def build_tool(entry: dict, where: str) -> Tool:
    """One tool from its YAML entry."""
    cls = TOOLS.get(entry["type"])
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"{where}: {entry['type']!r} is not a subclass of megarl.agent.tools.Tool")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: 'config' must be a mapping of constructor arguments, got {config!r}")
    try:
        return cls(entry.get("schema"), **config)
    except TypeError as err:
        raise ValueError(f"{where}: cannot build tool {entry['type']!r} with config {config}: {err}") from None


class ToolSession:
    """One trajectory's tools: state created on first use, rewards and release at the end."""

    def __init__(self, tools: dict[str, Tool], sample):
        self.tools = tools
        self.sample = sample
        self.states: dict[str, Any] = {}
        self._creating: dict[str, asyncio.Task] = {}
        self.close_errors: list[str] = []

    async def execute(self, tool: Tool, arguments: dict):
        """Create the tool's state if needed, then run the call."""
        if tool.name not in self.states:
            if tool.name not in self._creating:
                self._creating[tool.name] = asyncio.ensure_future(call_maybe_async(tool.create, self.sample))
            self.states[tool.name] = await asyncio.shield(self._creating[tool.name])
        return await call_maybe_async(tool.execute, self.states[tool.name], arguments)

    async def close(self) -> dict[str, float]:
        """Every created tool's trajectory reward (by tool name), then release them all. A tool whose
        reward or release raises is skipped and named in `close_errors`, never raised."""
        rewards = {}
        for name, state in self.states.items():
            tool = self.tools[name]
            for step in ("reward", "release"):
                try:
                    value = await call_maybe_async(getattr(tool, step), state)
                except Exception as exc:  # noqa: BLE001 - a tool's bug is counted, not a crashed step
                    self.close_errors.append(f"{name}.{step} raised {type(exc).__name__}: {exc}")
                    continue
                if step == "reward" and value is not None:
                    rewards[name] = float(value)
        self.states.clear()
        return rewards
