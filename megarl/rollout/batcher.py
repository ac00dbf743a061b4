"""Batch-at-a-time scheduling with the continuous engine's contract: pause, resume and abort by id.

Owns: `BatchScheduler` (on the engine loop: queued requests, the batch runner, pause modes) and
`TokenGate` (shared with the thread that runs a batch: it parks that thread between two forward
passes while paused and tells it which of its requests were aborted). The embedded engine runs
one batch at a time in a worker thread: a request that arrives while a batch runs joins the next
batch; but the batch itself stops at token boundaries for a pause (keep: parked until `resume`,
then it continues on whatever weights were loaded meanwhile) and ends aborted rows there with
their partial output. Imports the standard library and `base` only.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from megarl.rollout.base import Completion, SamplingParams


@dataclass
class Pending:
    """A request waiting for, or in, a batch."""

    prompt: list[int]
    params: SamplingParams
    request_id: str
    seq: int
    """Arrival order (a pause in mode wait drains the requests that arrived before it)."""
    future: asyncio.Future = field(repr=False)


class TokenGate:
    """Where a running batch meets pauses and aborts: between two forward passes."""

    def __init__(self):
        self._cond = threading.Condition()
        self._hold = False
        self._parked = False
        self._running = False
        self._aborted: set[str] = set()

    # -- the batch thread -------------------------------------------------------------------
    def checkpoint(self, request_ids: Iterable[str]) -> set[str]:
        """Park while held; then the ids among `request_ids` that were aborted."""
        with self._cond:
            while self._hold:
                self._parked = True
                self._cond.notify_all()
                self._cond.wait()
            self._parked = False
            return {r for r in request_ids if r in self._aborted}

    def finished(self, request_ids: Iterable[str]) -> None:
        """The batch is over (its aborted ids are forgotten)."""
        with self._cond:
            self._running = False
            self._aborted.difference_update(request_ids)
            self._cond.notify_all()

    # -- the engine loop ----------------------------------------------------------------------
    def started(self) -> None:
        with self._cond:
            self._running = True

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._cond:
            self._aborted.update(request_ids)

    def hold(self, on: bool) -> None:
        with self._cond:
            self._hold = on
            self._cond.notify_all()

    def wait_quiet(self, *, parked_ok: bool) -> None:
        """Block until no batch runs (or, with `parked_ok`, the running one is parked)."""
        with self._cond:
            while self._running and not (parked_ok and self._parked):
                self._cond.wait()


class BatchScheduler:
    """The queue and the batch runner of a batch-at-a-time engine (all methods on the engine loop).

    run_batch(list of `Pending`) → per request its completions, run in a worker thread with the
    gate; aborted(pending) → the completions of a request aborted before it started.
    """

    def __init__(
        self,
        run_batch: Callable[[list[Pending]], list[list[Completion]]],
        aborted: Callable[[Pending], list[Completion]],
    ):
        self.gate = TokenGate()
        self._run_batch, self._aborted = run_batch, aborted
        self._queue: list[Pending] = []
        self._admit_below = math.inf  # requests with seq below this may start (a pause lowers it)
        self._next_seq = 0
        self._runner: asyncio.Task | None = None
        self._batch_ids: set[str] = set()  # the running batch's requests

    async def submit(self, prompt: list[int], params: SamplingParams, request_id: str) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append(Pending(prompt, params, request_id, self._next_seq, future))
        self._next_seq += 1
        self._kick()
        try:
            return await future
        except asyncio.CancelledError:  # the caller went away: do not generate for nobody
            self.abort([request_id])
            raise

    def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for pending in [p for p in self._queue if p.request_id in ids]:
            self._queue.remove(pending)
            if not pending.future.done():
                pending.future.set_result(self._aborted(pending))
        self.gate.abort(ids)

    async def pause(self, mode: str) -> None:
        if mode == "wait":
            self._admit_below = self._next_seq  # what arrived before the pause drains
            while self._runner is not None and not self._runner.done():
                await asyncio.shield(self._runner)
        self._admit_below = -1
        if mode == "abort":
            self.abort([p.request_id for p in self._queue] + list(self._batch_ids))
        self.gate.hold(mode == "keep")
        await asyncio.to_thread(self.gate.wait_quiet, parked_ok=mode == "keep")

    async def resume(self) -> None:
        self._admit_below = math.inf
        self.gate.hold(False)
        self._kick()

    def _kick(self) -> None:
        if self._queue and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let concurrent callers enqueue
        while True:
            batch = [p for p in self._queue if p.seq < self._admit_below and not p.future.done()]
            if not batch:
                return
            taken = {id(p) for p in batch}
            self._queue = [p for p in self._queue if id(p) not in taken]
            self._batch_ids = {p.request_id for p in batch}
            self.gate.started()  # before the thread starts: a pause must see this batch
            try:
                results = await asyncio.to_thread(self._run_gated, batch)
            except BaseException as exc:  # noqa: BLE001 - every waiting request gets the error
                results = exc
            self._batch_ids = set()
            for i, pending in enumerate(batch):
                if not pending.future.done():
                    if isinstance(results, BaseException):
                        pending.future.set_exception(results)
                    else:
                        pending.future.set_result(results[i])

    def _run_gated(self, batch: list[Pending]) -> list[list[Completion]]:
        try:
            return self._run_batch(batch)
        finally:
            self.gate.finished(p.request_id for p in batch)
