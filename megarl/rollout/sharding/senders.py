"""Senders for one engine: in place (the engine is in this process) or by IPC, and the choice between them.

Owns: `InPlaceSender` (views of each `FlatBucket` streamed into the engine's own loading, under its
lock) and `sender_for(engine)`, the one place that decides how an engine object takes weights:
an engine whose model lives in another process (`engine.in_process` False: vLLM's engine core in a
child) gets an `ipc.IpcSender`, every other one an `InPlaceSender`. The broadcast sender (engine
servers in other processes, `broadcast.py`) is built by whoever forms the weight group.

Engines are duck-typed (`check_update(specs, partial=...)`, `load(weights, version)`,
`holds_update_tensors`, `in_process`; `adopts_update(specs)`, `update_buffers` and `load_buckets` to take
synced buckets as parameters; `load_by_ipc` for IPC): this module imports no engine, so
`base.py` can use it without an import circle.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from megarl.rollout.sharding.ipc import IpcSender
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import (
    FlatBucket,
    Sender,
    announced,
    check_bucket,
    checked_tensors,
    pending_tensors,
)


class InPlaceSender:
    """An engine in this process: each bucket's tensors, as views, go straight into its loading.

    `adopt` (a sharding manager's syncs): where the engine can (`adopts_update(specs)`: the embedded
    engine on CPU or its GPU, a dense model in the engine's dtype), `check` sets `adopt_into` to the engine's own
    buffers (`update_buffers`); the manager then lands every bucket there and the engine takes them as
    its parameters (`load_buckets`): from the second sync on the ranks write into the model and
    nothing is copied at the engine.

    `checks_as_it_copies`: the engine has `load_checked` (the embedded engine); buckets that carry the
    sender's checksums (a broadcast receiver's) then go in as `protocol.pending_tensors`, each tensor
    checked as it is copied instead of read once more before.
    """

    shares_buffers = False

    def __init__(self, engine, *, adopt: bool = False):
        self.engine = engine
        self.adopt = adopt and hasattr(engine, "load_buckets")
        self.keeps_buffers = bool(getattr(engine, "holds_update_tensors", False))
        self.checks_as_it_copies = hasattr(engine, "load_checked")
        self.adopt_into = None
        self._announced = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced, self.adopt_into = None, None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)
        if self.adopt and not partial and self.engine.adopts_update(specs):
            self.adopt_into = self.engine.update_buffers

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        if self.adopt_into is not None:
            self.adopt_into = None  # this sync's only (the manager has it): the next `check` decides again
            return self.engine.load_buckets((check_bucket(b, self._announced) for b in buckets), version)
        if self.checks_as_it_copies:
            return self.engine.load_checked(pending_tensors(buckets, self._announced), version)
        return self.engine.load(checked_tensors(buckets, self._announced), version)


def sender_for(engine, *, verify: bool = True, adopt: bool = False) -> Sender:
    """The sender that moves flat buckets into `engine`: IPC when its model is in another process (its
    buckets checked on arrival unless `verify` is False); in place, where nothing travels, otherwise
    (`adopt`, for a sharding manager's syncs: an engine that can takes the synced buckets as its
    parameters, `InPlaceSender`)."""
    if getattr(engine, "in_process", True):
        return InPlaceSender(engine, adopt=adopt)
    return IpcSender(engine, verify=verify, adopt=adopt)
