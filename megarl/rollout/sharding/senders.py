"""Senders for one engine: in place (the engine is in this process) or by IPC, and the choice between them.

Owns: `InPlaceSender` (views of each `FlatBucket` streamed into the engine's own loading, under its
lock) and `sender_for(engine)`, the one place that decides how an engine object takes weights:
an engine whose model lives in another process (`engine.in_process` False: vLLM's engine core in a
child) gets an `ipc.IpcSender`, every other one an `InPlaceSender`. The broadcast sender (engine
servers in other processes, `broadcast.py`) is built by whoever forms the weight group.

Engines are duck-typed (`check_update(specs, partial=...)`, `load(weights, version)`,
`holds_update_tensors`, `in_process`; `adopts_update_buffers` + `load_buckets` to take kept buffers as
parameters; `load_by_ipc` for IPC): this module imports no engine, so
`base.py` can use it without an import circle.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from megarl.rollout.sharding.ipc import IpcSender
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import FlatBucket, Sender, announced, check_bucket, checked_tensors


class InPlaceSender:
    """An engine in this process: each bucket's tensors, as views, go straight into its loading.

    An engine that `adopts_update_buffers` (the embedded engine on CPU) gets the buckets themselves
    (`load_buckets`); where the sharding manager can keep a buffer per bucket from sync to sync
    (`adopts_buffers`: `ShardingManager.sync` decides), the engine takes those buffers as its
    parameters: from the second sync on the ranks write into the model and nothing is copied at the
    engine.
    """

    def __init__(self, engine, *, adopt: bool = True):
        self.engine = engine
        self.adopts_buffers = adopt and bool(getattr(engine, "adopts_update_buffers", False))
        self.keeps_buffers = bool(getattr(engine, "holds_update_tensors", False))
        self.shares_buffers = False
        self._announced = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced = None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        if self.adopts_buffers:
            return self.engine.load_buckets((check_bucket(b, self._announced) for b in buckets), version)
        return self.engine.load(checked_tensors(buckets, self._announced), version)


def sender_for(engine, *, verify: bool = True, adopt: bool = True) -> Sender:
    """The sender that moves flat buckets into `engine`: IPC when its model is in another process (its
    buckets checked on arrival unless `verify` is False); in place, where nothing travels, otherwise
    (`adopt`: an engine that can may take the sharding manager's kept buffers as its parameters; for
    the sharding manager's syncs, not for buckets that are received, checked and then loaded)."""
    if getattr(engine, "in_process", True):
        return InPlaceSender(engine, adopt=adopt)
    return IpcSender(engine, verify=verify)
