"""Senders for one engine: in place (the engine is in this process) or by IPC, and the choice between them.

Owns: `InPlaceSender` (views of each `FlatBucket` streamed into the engine's own loading, under its
lock) and `sender_for(engine)`, the one place that decides how an engine object takes weights:
an engine whose model lives in another process (`engine.in_process` False: vLLM's engine core in a
child) gets an `ipc.IpcSender`, every other one an `InPlaceSender`. The broadcast sender (engine
servers in other processes, `broadcast.py`) is built by whoever forms the weight group.

Engines are duck-typed (`check_update(specs, partial=...)`, `load(weights, version)`,
`holds_update_tensors`, `in_process`; `load_by_ipc` for IPC): this module imports no engine, so
`base.py` can use it without an import circle.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from megarl.rollout.sharding.ipc import IpcSender
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import FlatBucket, Sender, announced, checked_tensors


class InPlaceSender:
    """An engine in this process: each bucket's tensors, as views, go straight into its loading."""

    shares_buffers = False

    def __init__(self, engine):
        self.engine = engine
        self.keeps_buffers = bool(getattr(engine, "holds_update_tensors", False))
        self._announced = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced = None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        return self.engine.load(checked_tensors(buckets, self._announced), version)


def sender_for(engine, *, verify: bool = True) -> Sender:
    """The sender that moves flat buckets into `engine`: IPC when its model is in another process (its
    buckets checked on arrival unless `verify` is False); in place, where nothing travels, otherwise."""
    if getattr(engine, "in_process", True):
        return InPlaceSender(engine)
    return IpcSender(engine, verify=verify)
