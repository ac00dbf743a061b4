"""One continuously batched rollout engine as a discrete-event model, and the router in front of the engines.

Owns `SimEngine`: up to `max_seqs` sequences decode together, each gaining one token per decode step of
`Decode.step_s(running)` seconds; the rest wait in a FIFO queue and start as soon as a slot frees. Between
two events (a sequence finishing, one arriving, a pause) the occupancy is constant, so the engine advances
in one jump: work is O(sequences * log) however long the responses are. Pure Python; imports nothing from
megarl but the model.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

from megarl.utils.simulate.model import Decode

_EPS = 1e-9


class SimEngine:
    """Decodes sequences `(seq_id, tokens)`; `clock` is the time its token counter is valid at."""

    def __init__(self, decode: Decode, max_seqs: int):
        self.decode, self.max_seqs = decode, max_seqs
        self.running: list[tuple[float, int]] = []  # heap of (token count at which it finishes, seq id)
        self.started: dict[int, float] = {}  # seq id -> token count when it started (for aborts)
        self.queue: deque[tuple[int, int]] = deque()
        self.tokens = 0.0  # tokens every running sequence has gained since the engine started
        self.clock = 0.0
        self.paused_until = 0.0
        self.busy_s = 0.0  # seconds with a sequence decoding (not paused)
        self.seq_s = 0.0  # sequence-seconds decoded (running sequences x seconds): mean occupancy = seq_s / time
        self.epoch = 0  # bumped whenever the next finish moves: older scheduled events are stale

    @property
    def outstanding(self) -> int:
        return len(self.running) + len(self.queue)

    def advance(self, t: float) -> None:
        """Decode until `t` (no sequence may finish before `t`: the caller goes event by event)."""
        start = max(self.clock, self.paused_until)
        if self.running and t > start:
            self.tokens += (t - start) / self.decode.step_s(len(self.running))
            self.busy_s += t - start
            self.seq_s += (t - start) * len(self.running)
        self.clock = max(self.clock, t)

    def submit(self, t: float, seq_id: int, tokens: int) -> None:
        self.advance(t)
        self.queue.append((seq_id, tokens))
        self._fill()

    def _fill(self) -> None:
        while self.queue and len(self.running) < self.max_seqs:
            seq_id, tokens = self.queue.popleft()
            heapq.heappush(self.running, (self.tokens + tokens, seq_id))
            self.started[seq_id] = self.tokens
        self.epoch += 1

    def next_finish(self) -> Optional[float]:
        """When the next running sequence finishes at the current occupancy (None: nothing running)."""
        if not self.running:
            return None
        start = max(self.clock, self.paused_until)
        return start + max(0.0, self.running[0][0] - self.tokens) * self.decode.step_s(len(self.running))

    def finish(self, t: float) -> list[int]:
        """Advance to `t` and retire the sequences done by then; queued ones take their slots."""
        self.advance(t)
        done = []
        while self.running and self.running[0][0] <= self.tokens + _EPS:
            done.append(heapq.heappop(self.running)[1])
            self.started.pop(done[-1])
        self._fill()
        return done

    def pause(self, t: float, seconds: float) -> None:
        """A weight update: decode nothing in [t, t + seconds]."""
        self.advance(t)
        self.paused_until = max(self.paused_until, t + seconds)
        self.epoch += 1

    def abort_all(self, t: float) -> tuple[list[int], float]:
        """Abort every running and queued sequence: their ids and the tokens they had generated (lost)."""
        self.advance(t)
        lost = sum(self.tokens - self.started[seq_id] for _, seq_id in self.running)
        ids = [seq_id for _, seq_id in self.running] + [seq_id for seq_id, _ in self.queue]
        self.running, self.started, self.queue = [], {}, deque()
        self.epoch += 1
        return ids, lost


def least_outstanding(engines: list[SimEngine]) -> int:
    """The router's choice: the engine with the fewest running + queued sequences (lowest index on ties)."""
    return min(range(len(engines)), key=lambda i: (engines[i].outstanding, i))
