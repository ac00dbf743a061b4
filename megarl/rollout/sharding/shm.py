"""Same-host transport between the CPU ranks of one replica: senders write into the receiver's buffer.

Owns: `ShmPeers` (one rank's side: the places it announces as a receiver, the receivers' buffers it
has opened as a sender) and `host_id`. `transport.stream_buckets` uses it instead of gloo messages
when every rank of the replica runs on one host without CUDA (`ShardingManager` decides once, with
its plan). Per bucket and remote row, the rollout rank sends the row's place in its gathered buffer
(a `PLACE_BYTES` message: its pid, the file descriptor of the buffer's shared memory, a token naming
the buffer, the row's byte offset) and later waits for a one-element "written"; the sender waits for
the place, packs its shards straight into it (in HF layout into the flat bucket itself where the
bucket's rules allow: `Bucket.shards_write_flat`) and sends "written". The pack is the transfer: no
socket copies on either side (gloo's TCP moved a bucket at 1.5–2× the time of a copy) and the
senders' packs run in parallel, in their own processes, while the rollout rank unpacks the previous
bucket. A receiver only announces a place once it took the buffer for that bucket, i.e. once its
consumer is done with the buffer's previous bucket, so a sender never writes into memory still
being read.

The buffers are torch's file-descriptor shared memory (`protocol.alloc_flat(shared=True)`): the
segment is unlinked at creation, so a killed process (Ray's `kill`) leaves nothing in /dev/shm, and
a sender maps it by opening /proc/<receiver pid>/fd/<fd> (same user and pid namespace: part of
`host_id`). A sender opens each receiver buffer once and keeps the mapping across syncs (a fresh
mapping costs page faults on first touch, several times the copy itself), keyed by the receiver's
token for that buffer (a freed buffer's fd number can come back for a new one); `end_sync` closes
the ones the last `KEEP_SYNCS` syncs did not use (a receiver's ring grew). Not just the last sync:
one manager alternates between the rings of its consumers (an engine in this process, one in
another: `iter_weights` for an export between IPC syncs), and reopening the other's buffers every
time cost a gather 1.7×; with 4 kept syncs, a round of `benchmarks/weight_sync.py` (four syncs of other
consumers between two IPC syncs) remapped and faulted in the IPC buffers every time, ~90 ms of a 0.4 GB sync.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import weakref
from typing import Optional

import torch

PLACE_BYTES = 512
KEEP_SYNCS = 8


def host_id(min_free_bytes: int = 0) -> Optional[str]:
    """Names this machine, boot, /dev/shm mount and pid namespace: ranks with equal ids can open each
    other's shared memory through /proc/<pid>/fd (two containers on one host have mounts and pid
    namespaces of their own, even with the host's name).

    None where /dev/shm has less than `min_free_bytes` free: a container's default /dev/shm is 64 MiB,
    and touching a shared page beyond its size kills the process (SIGBUS) instead of raising.
    """
    try:
        mount, pids = os.stat("/dev/shm").st_dev, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    if free_bytes() < min_free_bytes:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{mount}/{pids}"


def ring_room(bucket_bytes: int) -> int:
    """/dev/shm a sync's shared rings may take on a rollout rank (`transport.SyncBuffers`: 3 buckets, and a
    bucket may exceed the bound)."""
    return 4 * max(bucket_bytes, 256 << 20)


def free_bytes() -> int:
    """Bytes free in /dev/shm (0 where there is none)."""
    try:
        fs = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return fs.f_bavail * fs.f_frsize


class ShmPeers:
    """One rank's shared-memory places: announced (receiver) and opened (sender)."""

    def __init__(self):
        self._opened: dict[tuple[int, int], torch.Tensor] = {}  # (receiver pid, token) → the mapping here
        self._last_used: dict[tuple[int, int], int] = {}  # → the sync that last wrote into it
        self._syncs = 0
        self._tokens: dict[int, tuple[weakref.ref, int]] = {}  # receiver: storage address → (storage, token)
        self._next_token = itertools.count()

    def place(self, row: torch.Tensor) -> torch.Tensor:
        """The message naming `row` (a slice of a shared CPU buffer from `protocol.alloc_flat`)."""
        storage = row.untyped_storage()
        fd, nbytes = storage._share_fd_cpu_()  # the buffer's own descriptor (moved into shared memory if not yet)
        offset = row.storage_offset() * row.element_size()
        message = pickle.dumps((os.getpid(), fd, nbytes, self._token(storage), offset))
        out = torch.zeros(PLACE_BYTES, dtype=torch.uint8)
        out[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        return out

    def _token(self, storage: torch.UntypedStorage) -> int:
        known = self._tokens.get(storage.data_ptr())
        if known is None or known[0]() is not storage:
            known = self._tokens[storage.data_ptr()] = (weakref.ref(storage), next(self._next_token))
        return known[1]

    def open(self, message: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The row a `place` message names, as [numel] of `dtype`, mapped into this process."""
        pid, fd, nbytes, token, offset = pickle.loads(message.numpy().tobytes())
        key = (pid, token)
        whole = self._opened.get(key)
        if whole is None:
            whole = self._opened[key] = torch.from_file(f"/proc/{pid}/fd/{fd}", True, nbytes, dtype=torch.uint8)
        self._last_used[key] = self._syncs
        size = numel * torch.empty((), dtype=dtype).element_size()
        return whole[offset : offset + size].view(dtype)

    def end_sync(self) -> None:
        """Close the receivers' files the last `KEEP_SYNCS` syncs did not write into."""
        for key, last in list(self._last_used.items()):
            if self._syncs - last >= KEEP_SYNCS:
                del self._opened[key], self._last_used[key]
        self._tokens = {ptr: known for ptr, known in self._tokens.items() if known[0]() is not None}
        self._syncs += 1

    @staticmethod
    def message() -> torch.Tensor:
        """A buffer for one incoming place."""
        return torch.empty(PLACE_BYTES, dtype=torch.uint8)


def same_host(hosts: list[Optional[str]]) -> bool:
    """Whether every rank reported the same host id (None: a rank with CUDA, or too little /dev/shm)."""
    return bool(hosts) and None not in hosts and len(set(hosts)) == 1
