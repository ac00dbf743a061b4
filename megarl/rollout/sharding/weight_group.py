"""The weight group: the process group a broadcast weight update travels over (`broadcast.py`).

Owns: `WeightGroup`, a gloo or NCCL process group of one trainer rank (rank 0) and the engine servers (ranks
1..N), built from a TCPStore of its own, outside the default group, so a trainer rank that is already in its
training world and Ray engine actors can share it; and the few collectives the broadcast transport uses on it
(tensor and object broadcasts, a sync point, an all-gather of short messages).
"""

from __future__ import annotations

import datetime
import pickle
from typing import Optional

import torch

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

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, wait: bool = True):
        """Broadcast `tensor` from `src`; `wait=False` returns the work to wait on (the bytes move meanwhile)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        work = self.pg.broadcast([tensor], opts)
        if not wait:
            return work
        work.wait()
        return None

    def broadcast_object(self, obj=None, src: int = 0):
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def sync_point(self) -> None:
        """Return once every member reached its own call (a one-element all-reduce)."""
        self.pg.allreduce([torch.zeros(1, dtype=torch.int64, device=self.device)]).wait()

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
