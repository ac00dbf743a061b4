"""Broadcast transport: one trainer rank → N engine servers over their own process group.

Owns: `WeightGroup` (a gloo or NCCL process group built from a TCPStore, outside the
default group, so a trainer rank that is already in its training world and Ray engine actors
can share it), `BroadcastSender` and `BroadcastReceiver`.

One update: `check` broadcasts a small header (the planned HF names, shapes and dtypes), every
receiver checks it against its engine and the group all-gathers the verdicts, so a bad update fails
on every member with the engine's message before any weight moves; then `send` broadcasts the
policy version and, per `FlatBucket`, a 3-number control message, the bucket's layout (entries;
only when it differs from what the receivers hold for that position, so once per model) and the
bucket's buffer as it is (no concatenation; copied only if the group lives on another device).
Receivers take each bucket into a buffer of its own (fresh, or for an engine in another process
kept per bucket position from update to update) and hand it to their engine's own sender
(`senders.sender_for`: in place, or IPC for a vLLM core in a child process), and a final
all-gather collects the engines' versions. gloo on CPU (tested), NCCL on GPU.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Iterable, Optional, Sequence

import torch

from megarl.rollout.sharding.plan import HFSlot, HFSpec
from megarl.rollout.sharding.protocol import FlatBucket, WeightUpdateError, alloc_flat, bucket_tensors
from megarl.rollout.sharding.senders import sender_for
from megarl.rollout.sharding.transport import KeptBuffers

MESSAGE_BYTES = 4096


class WeightGroup:
    """A process group of the sender (rank 0) and engine receivers (ranks 1..N)."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo", timeout_s: float = 300.0
    ):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight-group backend {backend!r} is unknown; use gloo (CPU) or nccl (GPU)")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj=None, src: int = 0):
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_messages(self, message: Optional[str]) -> list[Optional[str]]:
        """Every member's message (None: no message); each is cut to MESSAGE_BYTES."""
        data = (message or "").encode()[: MESSAGE_BYTES - 1]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if message is not None:
            mine[0] = 1
            mine[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.pg.allgather([out], [mine]).wait()
        return [bytes(t[1:].cpu().numpy()).rstrip(b"\0").decode() if t[0] else None for t in out]


_BEGIN, _BUCKET, _END = 2, 1, 0
"""Kinds of the control message that precedes every part of an update: [kind, value, new layout]."""


class BroadcastSender:
    """Trainer side, rank 0 of its weight group: a `Sender` to every engine server in the group."""

    keeps_buffers = False  # a broadcast has completed on every member before the next bucket is asked for
    shares_buffers = False

    def __init__(self, group: WeightGroup):
        if group.rank != 0:
            raise ValueError("the sender must be rank 0 of its weight group")
        self.group = group
        self._layouts: list = []  # (dtype, entries) per bucket position, as the receivers have them

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        """Announce the update; raises the first engine's WeightUpdateError (on every member)."""
        header = {
            "specs": [(s.name, tuple(s.shape), str(s.dtype).replace("torch.", "")) for s in specs],
            "partial": partial,
        }
        self.group.broadcast_object(header)
        failures = [(i, m) for i, m in enumerate(self.group.all_gather_messages(None)) if m]
        if failures:
            raise WeightUpdateError(f"engine server {failures[0][0]} rejected the update: {failures[0][1]}")

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """One broadcast per bucket buffer, as it is; returns the lowest engine version after the update."""
        self._control(_BEGIN, version)
        for position, bucket in enumerate(buckets):
            layout = (str(bucket.dtype).replace("torch.", ""), tuple(bucket.entries))
            new = position >= len(self._layouts) or self._layouts[position] != layout
            self._control(_BUCKET, bucket.buffer.numel(), new)
            if new:
                self.group.broadcast_object(layout)
                self._layouts[position : position + 1] = [layout]
            buffer = bucket.buffer if bucket.buffer.device == self.group.device else bucket.buffer.to(self.group.device)
            self.group.broadcast(buffer)
        self._control(_END)
        versions = self.group.all_gather_messages("0")
        return min(int(v) for v in versions[1:])

    def _control(self, kind: int, value: int = 0, new: bool = False) -> None:
        self.group.broadcast(torch.tensor([kind, value, int(new)], dtype=torch.int64, device=self.group.device))

    def update(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
        """Send a list of HF-named tensors (tools and tests), bucketed like any other update."""
        self.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights])
        return self.send(bucket_tensors(weights), version)

    def close(self) -> None:
        """Tell the receivers to leave their receive loop."""
        self.group.broadcast_object({"close": True})


class BroadcastReceiver:
    """Engine side: `receive_update()` blocks for one update and loads it into `engine` (its own sender)."""

    def __init__(self, group: WeightGroup, engine):
        self.group, self.engine = group, engine
        self.local = sender_for(engine)
        self._layouts: list = []
        # an engine in another process (IPC): one shared-memory buffer per bucket position, reused by
        # every update (no fresh shared-memory pages to allocate and zero after the first)
        self._kept = KeptBuffers() if self.local.shares_buffers else None

    def receive_update(self) -> Optional[int]:
        """The engine's new version; None when the sender closed the group.

        Raises WeightUpdateError (and keeps the previous weights) when any member rejected the update.
        """
        header = self.group.broadcast_object()
        if header.get("close"):
            return None
        specs = [HFSpec(n, tuple(s), getattr(torch, d)) for n, s, d in header["specs"]]
        try:
            self.local.check(specs, partial=header["partial"])
            verdict = None
        except WeightUpdateError as err:
            verdict = str(err)
        failures = [m for m in self.group.all_gather_messages(verdict) if m]
        if failures:
            raise WeightUpdateError(failures[0])
        kind, version, _ = self._control()
        if kind != _BEGIN:
            raise RuntimeError(f"weight group out of step: expected the start of an update, got message kind {kind}")
        version = self.local.send(self._buckets(), version)
        self.group.all_gather_messages(str(version))
        return version

    def _control(self) -> list[int]:
        message = torch.empty(3, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(message)
        return message.tolist()

    def _buckets(self):
        """Each broadcast bucket in a fresh buffer (the engine may keep it), until the sender's end mark."""
        position = 0
        while True:
            kind, numel, new = self._control()
            if kind == _END:
                return
            if new:
                self._layouts[position : position + 1] = [self.group.broadcast_object()]
            dtype, entries = self._layouts[position]
            buffer = (
                self._kept.take(position, numel, getattr(torch, dtype), self.group.device)
                if self._kept
                else alloc_flat(numel, getattr(torch, dtype), self.group.device)
            )
            self.group.broadcast(buffer)
            yield FlatBucket(buffer, tuple(HFSlot(*e) for e in entries))
            position += 1
