"""An OpenAI-compatible chat endpoint that routes to the rollout engines and records exact tokens.

Owns `ChatServer`: `/v1/chat/completions` (tools and tool calls included) and `/v1/models`,
served by uvicorn on its own thread and event loop (`start()` / `stop()`, or `with`). Any agent code
written against the `openai` client can drive a conversation while megarl keeps the trajectory:

* A session id comes from the `X-Session-Id` header, else the request's `user` field, else every
  request is its own session. `open_session(llm, loop)` routes a session's generation to an
  `AgentLLM` (run on `loop`, the event loop that owns it); other sessions use `llm_factory(session_id)`.
* Token-in, token-out: when a request's messages extend a conversation the session already holds
  (its messages + the assistant reply the server gave), only the new tool / user messages are
  rendered, as chat-template delta tokens (mask 0), after the recorded tokens; the model's tokens
  are the engine's verbatim. Otherwise (history edited, a system prompt changed) a new chain starts
  from the rendered messages. Each chain is one `Trajectory`; `close_session` returns them.
* The reply's `tool_calls` come from the run's tool parser (`AgentConfig.tool_parser`) when the
  request has `tools` (and `tool_choice` is not "none"); a malformed call stays in `content`.

Imports FastAPI and uvicorn (installed with vLLM) lazily, in `start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megarl.agent.base import AgentLLM, EngineLLM
from megarl.agent.chat import ChatRenderer
from megarl.agent.config import AgentConfig
from megarl.agent.openai_app import RequestError, build_app, parse_request
from megarl.agent.parsers import get_parser
from megarl.agent.trajectory import Trajectory
from megarl.rollout.base import SamplingParams


@dataclass
class _Chain:
    """One linear conversation of a session, as tokens and as the messages that produced them."""

    renderer: ChatRenderer
    messages: list[dict]
    trajectory: Trajectory
    tools: Optional[list[dict]]
    last_model_ids: list[int] = field(default_factory=list)
    malformed_calls: int = 0


@dataclass
class _Session:
    llm: AgentLLM
    loop: Optional[asyncio.AbstractEventLoop]
    chains: list[_Chain] = field(default_factory=list)
    lock: Optional[asyncio.Lock] = None


class ChatServer:
    """`/v1/chat/completions` over the rollout engines, recording every session's tokens."""

    def __init__(
        self,
        tokenizer,
        *,
        engine=None,
        llm_factory: Optional[Callable[[str], AgentLLM]] = None,
        config: Optional[AgentConfig] = None,
        params: Optional[SamplingParams] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "megarl",
    ):
        if llm_factory is None and engine is None:
            raise ValueError("ChatServer needs an engine or an llm_factory(session_id) -> AgentLLM")
        self.tokenizer = tokenizer
        self.llm_factory = llm_factory or (lambda sid: EngineLLM(engine, sid))
        self.config = config or AgentConfig()
        self.params = params or SamplingParams(stop_token_ids=_eos_ids(tokenizer))
        self.parser = get_parser(self.config.tool_parser)
        self.host, self.port, self.model_name = host, port, model_name
        self.sessions: dict[str, _Session] = {}
        self._guard = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._server = None

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL for `openai.OpenAI(base_url=...)`, ending in /v1."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "ChatServer":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[sock])), daemon=True, name="megarl-chat-server"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the chat server did not start on {self.host}:{self.port} in {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sessions ---------------------------------------------------------------------------------
    def open_session(
        self, llm: AgentLLM, loop: Optional[asyncio.AbstractEventLoop] = None, session_id: Optional[str] = None
    ) -> str:
        """Route session `session_id` (default: the llm's) to `llm`, run on `loop` (default: the server's)."""
        sid = session_id or getattr(llm, "session_id", None) or uuid.uuid4().hex
        with self._guard:
            self.sessions[sid] = _Session(llm, loop)
        return sid

    def trajectories(self, session_id: str) -> list[Trajectory]:
        """The session's chains so far, as trajectories (metrics filled)."""
        session = self.sessions.get(session_id)
        return [] if session is None else [_finished(c) for c in session.chains]

    def close_session(self, session_id: str) -> list[Trajectory]:
        """Forget the session; returns its trajectories."""
        with self._guard:
            session = self.sessions.pop(session_id, None)
        return [] if session is None else [_finished(c) for c in session.chains]

    def _session(self, session_id: str) -> _Session:
        with self._guard:
            if session_id not in self.sessions:
                self.sessions[session_id] = _Session(self.llm_factory(session_id), None)
            session = self.sessions[session_id]
            if session.lock is None:
                session.lock = asyncio.Lock()
            return session

    # -- one request ------------------------------------------------------------------------------
    async def chat(self, body: dict, session_id: Optional[str]) -> dict:
        """Answer one chat-completions request (the FastAPI route calls this)."""
        request = parse_request(body, self.params)
        sid = session_id or body.get("user") or uuid.uuid4().hex
        session = self._session(sid)
        async with session.lock:
            chain = self._chain(session, request["messages"], request["tools"])
            completion = await self._generate(session, chain, request["params"])
            message, reason = self._reply(chain, completion, request)
        return _response(self.model_name, message, reason, chain, completion)

    def _chain(self, session: _Session, messages: list[dict], tools: Optional[list[dict]]) -> _Chain:
        """The chain these messages continue (observation tokens appended), or a new one."""
        for chain in reversed(session.chains):
            new = _continuation(chain, messages, tools)
            if new is not None:
                ids = chain.renderer.observation_ids(chain.last_model_ids, new)
                chain.trajectory.add_observation(
                    new[0]["role"], ids, text="\n".join(str(m.get("content") or "") for m in new)
                )
                chain.messages.extend(new)
                return chain
        renderer = ChatRenderer(self.tokenizer, tools)
        chain = _Chain(renderer, [dict(m) for m in messages], Trajectory(renderer.prompt_ids(messages)), tools)
        session.chains.append(chain)
        return chain

    async def _generate(self, session: _Session, chain: _Chain, params: SamplingParams):
        traj = chain.trajectory
        budget = self.config.max_response_tokens - len(traj.response_ids)
        if budget <= 0:
            raise RequestError(
                f"this conversation has used its {self.config.max_response_tokens} response tokens"
                " (AgentConfig.max_response_tokens); start a new session"
            )
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, budget), n=1)
        coro = session.llm.generate(traj.prompt_ids + traj.response_ids, params)
        if session.loop is not None and session.loop is not asyncio.get_running_loop():
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, session.loop))
        return await coro

    def _reply(self, chain: _Chain, completion, request: dict) -> tuple[dict, str]:
        """Record the completion; the assistant message (with tool_calls) and the finish reason."""
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        turn = chain.trajectory.add_model_turn(
            completion.token_ids,
            completion.logprobs or [0.0] * len(completion.token_ids),
            completion.version,
            text=text,
            finish_reason=completion.finish_reason,
        )
        chain.last_model_ids = list(completion.token_ids)
        chain.trajectory.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
        message = {"role": "assistant", "content": text}
        if request["tools"] and request["tool_choice"] != "none":
            parsed = self.parser(text)
            good = [c for c in parsed.calls if c.error is None]
            chain.malformed_calls += len(parsed.calls) - len(good)
            turn.tool_calls = [c.to_dict() for c in parsed.calls]
            if good:
                calls = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in good
                ]
                content = text if len(good) < len(parsed.calls) else parsed.content
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        chain.messages.append(message)
        reason = "tool_calls" if message.get("tool_calls") else completion.finish_reason
        return message, reason


def _eos_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def _norm(message: dict) -> tuple:
    """What must match for a message to count as the same turn (tool-call ids and JSON spacing aside)."""
    calls = tuple(
        (c.get("function", c).get("name"), _loads(c.get("function", c).get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return message.get("role"), message.get("content") or "", calls


def _loads(arguments: Any) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        value = arguments
    return json.dumps(value, sort_keys=True)


def _continuation(chain: _Chain, messages: list[dict], tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """The messages after the chain's own, when they only add tool / user turns after its last reply."""
    n = len(chain.messages)
    if tools != chain.tools or len(messages) <= n or chain.messages[-1].get("role") != "assistant":
        return None
    if any(_norm(a) != _norm(b) for a, b in zip(chain.messages, messages[:n])):
        return None
    new = [dict(m) for m in messages[n:]]
    return new if all(m.get("role") in ("tool", "user") for m in new) else None


def _finished(chain: _Chain) -> Trajectory:
    return chain.trajectory.finalize(malformed_tool_calls=chain.malformed_calls)


def _response(model: str, message: dict, reason: str, chain: _Chain, completion) -> dict:
    prompt_tokens = len(chain.trajectory.prompt_ids) + len(chain.trajectory.response_ids) - len(completion.token_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt_tokens + len(completion.token_ids),
        },
    }
