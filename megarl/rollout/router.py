"""Routing per-request calls over several engines: sticky per session, else least outstanding, bounded.

Owns: `EngineRouter`. The driver's engines (`megarl.controller.engines`: colocated engines in the
actor's workers, engine servers) and agent loops route every request through one:

    completions = await router.run(request_id, session_id, call)   # call(engine index) -> completions
    router.abort(request_ids)   # → {engine index: ids} to abort there; those requests are not rerun

* A session's first request goes to the engine with the fewest outstanding requests (ties: the
  lowest index); every later request of the session goes to that engine, whose prefix cache holds
  the conversation (sessions are forgotten least-recently-used first beyond `max_sessions`, or
  with `end_session`).
* At most `max_outstanding` requests per engine: the next one waits (a session's request waits
  for its own engine).
* No request is lost across a weight update: a request that comes back aborted (finish_reason
  "abort") although its caller did not abort it — an engine paused in mode abort for an update —
  runs again on the same engine (from its prompt, on the new weights).

Pure asyncio, no Ray or engine import; usable from one event loop at a time (a new loop, e.g. one
`asyncio.run` per step, takes over once the previous one is done).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Awaitable, Callable, Iterable, Optional

DEFAULT_MAX_OUTSTANDING = 256
"""Requests in flight per engine before `run` waits (continuous batching keeps them all busy)."""


class EngineRouter:
    """Assigns requests to `num_engines` engines and tracks what is outstanding where."""

    def __init__(
        self,
        num_engines: int,
        *,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        max_sessions: int = 100_000,
        max_reruns: int = 8,
    ):
        if num_engines < 1 or max_outstanding < 1:
            raise ValueError(
                f"a router needs num_engines >= 1 and max_outstanding >= 1, got {num_engines}, {max_outstanding}"
            )
        self.num_engines, self.max_outstanding = num_engines, max_outstanding
        self.max_sessions, self.max_reruns = max_sessions, max_reruns
        self.outstanding = [0] * num_engines
        self.reruns = 0
        """Requests run again after an engine aborted them (an update in pause mode abort)."""
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._requests: dict[str, int] = {}  # outstanding request id → engine index
        self._aborted: set[str] = set()  # aborted by the caller: not rerun
        self._changed: Optional[asyncio.Condition] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- choosing -----------------------------------------------------------------------------
    def pick(self, session_id: Optional[str] = None) -> Optional[int]:
        """The engine for a request of `session_id` now (None: it must wait for capacity)."""
        if session_id is not None and session_id in self._sessions:
            engine = self._sessions[session_id]
            return engine if self.outstanding[engine] < self.max_outstanding else None
        engine = min(range(self.num_engines), key=lambda e: (self.outstanding[e], e))
        return engine if self.outstanding[engine] < self.max_outstanding else None

    def engine_of(self, request_id: str) -> Optional[int]:
        """The engine serving an outstanding request (None: not outstanding)."""
        return self._requests.get(request_id)

    def session_engine(self, session_id: str) -> Optional[int]:
        return self._sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a finished conversation (its next request, if any, is routed afresh)."""
        self._sessions.pop(session_id, None)

    # -- running ------------------------------------------------------------------------------
    async def acquire(self, request_id: str, session_id: Optional[str] = None) -> int:
        """Wait for capacity, then count `request_id` as outstanding on its engine (returned)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already outstanding; request ids must be unique")
        changed = self._condition()
        async with changed:
            while (engine := self.pick(session_id)) is None:
                await changed.wait()
        self._requests[request_id] = engine
        self.outstanding[engine] += 1
        if session_id is not None:
            self._sessions[session_id] = engine
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return engine

    async def release(self, request_id: str) -> None:
        engine = self._requests.pop(request_id)
        self.outstanding[engine] -= 1
        self._aborted.discard(request_id)
        changed = self._condition()
        async with changed:
            changed.notify_all()

    async def run(self, request_id: str, session_id: Optional[str], call: Callable[[int], Awaitable[list]]) -> list:
        """`await call(engine)` on the routed engine; rerun while an engine (not the caller) aborted it."""
        engine = await self.acquire(request_id, session_id)
        try:
            for attempt in range(self.max_reruns + 1):
                completions = await call(engine)
                if request_id in self._aborted or not _aborted(completions):
                    return completions
                if attempt < self.max_reruns:
                    self.reruns += 1
            raise RuntimeError(
                f"request {request_id!r} was aborted by its engine {self.max_reruns + 1} times in a"
                " row (each weight update in pause mode abort ends it); not run again"
            )
        finally:
            await self.release(request_id)

    def abort(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Mark requests as aborted by their caller (they are not rerun); {engine: ids} to abort there."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._requests.get(request_id)
            if engine is not None:
                self._aborted.add(request_id)
                by_engine.setdefault(engine, []).append(request_id)
        return by_engine

    def _condition(self) -> asyncio.Condition:
        """The condition of the running event loop (a driver may run one loop per step: asyncio.run)."""
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:
            self._changed, self._loop = asyncio.Condition(), loop
        return self._changed


def _aborted(completions: list) -> bool:
    return any(getattr(c, "finish_reason", None) == "abort" for c in completions)
