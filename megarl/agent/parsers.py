"""Tool-call parsers: model text → (content, tool calls), one registered name per format.

Owns `ToolCall`, `Parsed` and the registry `TOOL_PARSERS`; every parser has the signature
`parse(text: str) -> Parsed`. Built in:

    hermes     `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, Hermes, many others)
    pythonic   a Python list of calls, `[search(query="x"), add(a=1, b=2)]` (Llama 3.2 / 4 style), read with `ast`
    mistral    `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`

A call that cannot be read becomes a `ToolCall` with `error` set (the loop shows the model an error
observation and counts it as malformed); parsers never raise on model text. `arguments` is always
a dict when `error` is None. Imports only the standard library.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.utils.registry import Registry

TOOL_PARSERS = Registry("tool parser", ("text",))


@dataclass
class ToolCall:
    """One call the model asked for."""

    name: str
    """Function name ('' when it could not be read)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments (a dict when the call parsed)."""
    raw: str = ""
    """The text of the call as the model wrote it."""
    error: Optional[str] = None
    """Why the call could not be read (malformed); None when it parsed."""
    id: str = ""
    """Call id (OpenAI `tool_call_id`); the loop numbers calls when the format has none."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "id": self.id, "error": self.error}


@dataclass
class Parsed:
    """A model turn split into what it said and what it called."""

    content: str
    """The text without the tool-call markup."""
    calls: list[ToolCall] = field(default_factory=list)
    """Calls in order, malformed ones included (with `error`)."""


def get_parser(name: str):
    """The parser registered as `name` (or at `pkg.module:fn`); unknown names list the valid ones."""
    return TOOL_PARSERS.get(name)


def _call_from_json(raw: str, obj: Any = None) -> ToolCall:
    """A ToolCall from `{"name": str, "arguments": dict | JSON string}`; errors say what is wrong."""
    if obj is None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            return ToolCall("", raw=raw, error=f"not valid JSON ({err.msg} at position {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", raw=raw, error='a call must be a JSON object with a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], raw=raw, error='"arguments" is a string that is not valid JSON')
    if not isinstance(args, dict):
        return ToolCall(obj["name"], raw=raw, error='"arguments" must be a JSON object')
    return ToolCall(obj["name"], args, raw=raw, id=str(obj.get("id") or ""))


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> Parsed:
    """`<tool_call>{json}</tool_call>` blocks; an unclosed block at the end is malformed."""
    calls, content = [], []
    last = 0
    for match in _HERMES.finditer(text):
        content.append(text[last : match.start()])
        last = match.end()
        body = match.group(1).strip()
        if not match.group(2):
            calls.append(ToolCall("", raw=match.group(0), error="<tool_call> is not closed by </tool_call>"))
        else:
            calls.append(_call_from_json(body))
    content.append(text[last:])
    return Parsed("".join(content).strip(), calls)


@TOOL_PARSERS.register("mistral")
def parse_mistral(text: str) -> Parsed:
    """`[TOOL_CALLS]` followed by a JSON list of {name, arguments} objects."""
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return Parsed(text.strip())
    content, _, rest = text.partition(marker)
    try:
        objs, _ = json.JSONDecoder().raw_decode(rest.strip())
    except json.JSONDecodeError as err:
        return Parsed(content.strip(), [ToolCall("", raw=rest, error=f"not valid JSON after [TOOL_CALLS] ({err.msg})")])
    objs = objs if isinstance(objs, list) else [objs]
    return Parsed(content.strip(), [_call_from_json(json.dumps(o), o) for o in objs])


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


@TOOL_PARSERS.register("pythonic")
def parse_pythonic(text: str) -> Parsed:
    """A Python list of calls with literal keyword arguments, at the end of the turn."""
    match = _PYTHONIC_START.search(text)
    if match is None:
        return Parsed(text.strip())
    content, raw = text[: match.start()].strip(), text[match.start() :].strip()
    try:
        tree = ast.parse(raw, mode="eval").body
    except SyntaxError as err:
        return Parsed(content, [ToolCall("", raw=raw, error=f"not a Python list of calls ({err.msg})")])
    if not isinstance(tree, ast.List):
        return Parsed(content, [ToolCall("", raw=raw, error="tool calls must be a Python list")])
    return Parsed(content, [_pythonic_call(node) for node in tree.elts])


def _pythonic_call(node: ast.expr) -> ToolCall:
    raw = ast.unparse(node)
    if not isinstance(node, ast.Call) or node.args:
        return ToolCall("", raw=raw, error="each item must be a call with keyword arguments only: f(a=1)")
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except ValueError:
        return ToolCall(
            ast.unparse(node.func), raw=raw, error="arguments must be literals (numbers, strings, lists, dicts)"
        )
    return ToolCall(ast.unparse(node.func), args, raw=raw)
