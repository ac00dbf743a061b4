"""The FastAPI app of `ChatServer` and the validation of chat-completions requests.

Owns `build_app(server)` (routes: POST /v1/chat/completions, GET /v1/models; errors as OpenAI's
`{"error": {"message", "type"}}` with HTTP 400) and `parse_request(body, base_params)`: messages,
tools, tool_choice and the sampling fields (temperature, top_p, max_tokens / max_completion_tokens,
seed; n must be 1; `stop` strings are refused: stopping is by token id). Imports FastAPI.
"""
# no `from __future__ import annotations`: FastAPI reads the route annotations (Request) at run time

import dataclasses
import time
from typing import Any

from megarl.rollout.base import SamplingParams


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and the message."""


ROLES = ("system", "user", "assistant", "tool")


def build_app(server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="megarl chat endpoint")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return JSONResponse(await server.chat(body, request.headers.get("x-session-id")))
        except (RequestError, ValueError) as err:
            return JSONResponse({"error": {"message": str(err), "type": "invalid_request_error"}}, status_code=400)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": int(time.time()), "owned_by": "megarl"}],
        }

    return app


def parse_request(body: dict[str, Any], base: SamplingParams) -> dict[str, Any]:
    """{messages, tools, tool_choice, params} of a request; bad fields raise naming the field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a 'role' in {ROLES}, got {m!r}")
        if not isinstance(m.get("content") or "", str):
            raise RequestError(f"messages[{i}].content must be a string (content parts are not supported)")
    tools = body.get("tools") or None
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools)
    ):
        raise RequestError("'tools' must be a list of {type: function, function: {name, parameters}} objects")
    if (body.get("n") or 1) != 1:
        raise RequestError("'n' must be 1: every completion is its own trajectory (send n requests)")
    if body.get("stop"):
        raise RequestError("'stop' strings are not supported: generation stops at the tokenizer's end-of-turn token")
    return {
        "messages": messages,
        "tools": tools,
        "tool_choice": body.get("tool_choice") or "auto",
        "params": _params(body, base),
    }


def _params(body: dict, base: SamplingParams) -> SamplingParams:
    fields = {}
    for key, name in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("max_completion_tokens", "max_tokens"),
        ("max_tokens", "max_tokens"),
    ):
        if body.get(key) is not None and name not in fields:
            fields[name] = body[key]
    try:
        return dataclasses.replace(base, n=1, logprobs=True, **fields)
    except (TypeError, ValueError) as err:
        raise RequestError(f"bad sampling fields {fields}: {err}") from None
