"""Broadcast transport: one trainer rank → N engine servers over their own process group.

Owns: `WeightGroup` (a gloo or NCCL process group built from a TCPStore, outside the
default group, so a trainer rank that is already in its training world and Ray engine actors
can share it), `BroadcastSender` and `BroadcastReceiver`.

One update: the sender broadcasts a small header (the planned HF names, shapes and dtypes; the
bucket layout only the first time, it is cached by the receivers), every receiver checks it
against its engine and the group all-gathers the verdicts, so a bad update fails on every member
with the engine's message before any weight moves; then one broadcast per bucket (the bucket's
HF tensors flattened into one buffer) that the receivers stream into `engine.update_weights`,
and a final all-gather of the engines' new versions. gloo on CPU (tested), NCCL on GPU.
"""
from __future__ import annotations

import datetime
import pickle
from typing import Iterable, Optional, Sequence

import torch

from megarl.rollout.sharding.plan import HFSpec

MESSAGE_BYTES = 4096


class WeightGroup:
    """A process group of the sender (rank 0) and engine receivers (ranks 1..N)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
                 timeout_s: float = 300.0):
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
        data = (message or "").encode()[:MESSAGE_BYTES - 1]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if message is not None:
            mine[0] = 1
            mine[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.pg.allgather([out], [mine]).wait()
        return [bytes(t[1:].cpu().numpy()).rstrip(b"\0").decode() if t[0] else None for t in out]


def _layout_of(plan_or_buckets) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """[(dtype name, [(hf name, shape), ...]) per bucket]."""
    return [(str(b.dtype).replace("torch.", ""), [(s.name, tuple(s.shape)) for s in b.hf]) for b in plan_or_buckets]


class BroadcastSender:
    """Trainer side. `sync` of the sharding manager calls `check_update(specs)`, then `send`."""

    def __init__(self, group: WeightGroup):
        if group.rank != 0:
            raise ValueError("the sender must be rank 0 of its weight group")
        self.group = group
        self._layout = None
        self._layout_sent = None
        self.version: Optional[int] = None
        """Policy version the engines take with the next update (None: each engine counts its own)."""

    def check_update(self, specs: Sequence[HFSpec], layout=None) -> None:
        """Announce the update; raises the first engine's WeightUpdateError (on every member)."""
        from megarl.rollout.base import WeightUpdateError

        layout = layout if layout is not None else self._layout
        header = {"specs": [(s.name, tuple(s.shape), str(s.dtype).replace("torch.", "")) for s in specs],
                  "layout": layout if layout != self._layout_sent else None, "version": self.version}
        self.group.broadcast_object(header)
        self._layout_sent = layout
        failures = [(i, m) for i, m in enumerate(self.group.all_gather_messages(None)) if m]
        if failures:
            raise WeightUpdateError(f"engine server {failures[0][0]} rejected the update: {failures[0][1]}")

    def send(self, plan, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """One broadcast per bucket (flattened HF tensors); returns the lowest engine version after it."""
        for tensors in buckets:
            flat = torch.cat([t.reshape(-1) for _, t in tensors]).to(self.group.device)
            self.group.broadcast(flat)
        versions = self.group.all_gather_messages("0")
        return min(int(v) for v in versions[1:])

    def bind_plan(self, plan) -> "BroadcastSender":
        """Use the bucket layout of a sharding plan (the manager does this before `check_update`)."""
        self._layout = _layout_of(plan.buckets)
        return self

    def update(self, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Send a list of HF-named tensors as one bucket (tools and tests; one dtype)."""
        specs = [HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights]
        layout = [(str(weights[0][1].dtype).replace("torch.", ""), [(s.name, s.shape) for s in specs])]
        self.check_update(specs, layout)
        return self.send(None, [list(weights)])

    def close(self) -> None:
        """Tell the receivers to leave their receive loop."""
        self.group.broadcast_object({"close": True})


class BroadcastReceiver:
    """Engine side: `receive_update()` blocks for one update and loads it into `engine`."""

    def __init__(self, group: WeightGroup, engine):
        self.group, self.engine = group, engine
        self._layout = None

    def receive_update(self) -> Optional[int]:
        """The engine's new version; None when the sender closed the group.

        Raises WeightUpdateError (and keeps the previous weights) when any member rejected the update.
        """
        from megarl.rollout.base import WeightUpdateError

        header = self.group.broadcast_object()
        if header.get("close"):
            return None
        if header["layout"] is not None:
            self._layout = header["layout"]
        specs = [HFSpec(n, tuple(s), getattr(torch, d)) for n, s, d in header["specs"]]
        try:
            self.engine.check_update(specs)
            verdict = None
        except WeightUpdateError as err:
            verdict = str(err)
        failures = [m for m in self.group.all_gather_messages(verdict) if m]
        if failures:
            raise WeightUpdateError(failures[0])
        version = self.engine.update_weights(self._stream(), specs=specs, version=header.get("version"))
        self.group.all_gather_messages(str(version))
        return version

    def _stream(self):
        for dtype, entries in self._layout:
            numels = [_numel(shape) for _, shape in entries]
            flat = torch.empty(sum(numels), dtype=getattr(torch, dtype), device=self.group.device)
            self.group.broadcast(flat)
            for (name, shape), piece in zip(entries, flat.split(numels)):
                yield name, piece.view(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
