"""IPC transport: a colocated vLLM worker in another process maps each bucket instead of copying it.

Owns: `IpcSender` (trainer side; a `Sender`) and `MegarlWorkerExtension` (mixed into vLLM's workers
with `worker_extension_cls`; `VLLMEngine` sets it). Per `FlatBucket` the trainer sends
`torch.multiprocessing.reductions.reduce_tensor` of the bucket's buffer as it is — a CUDA IPC
handle on GPU (the worker opens the same memory), a shared-memory handle on CPU (the sharding
manager allocates the buffer in shared memory: `Sender.shares_buffers`) — plus the entries (name,
shape, offset), over a `multiprocessing.connection` to the worker: nothing is flattened,
concatenated or re-bucketed on the way. The worker rebuilds the tensor, streams views of it into
ONE `reload_weights` call (vLLM's layer-wise reload must see a layer's tensors within one call)
and acknowledges; vLLM may keep a layer's views until the layer is complete, so every bucket has a
buffer of its own (`Sender.keeps_buffers`), which stays mapped while the worker holds it. After the
reload the worker applies the vLLM re-pack fixes (`megarl.rollout.vllm_patches`).

With several vLLM workers (rollout TP > 1, one per GPU), each worker connects to the listener
whose address is `address_template.format(rank=<worker's local rank>)`, i.e. the trainer rank on
its own GPU; every rollout rank of the sharding manager holds the full bucket (vLLM's weight
loaders slice it for their TP rank). Tested on CPU (shared memory); the CUDA path is the same code
with CUDA tensors and has not run here.

Must not import the vLLM engine module (`vllm_engine.py`): the engine is duck-typed
(`check_update`, `load_by_ipc`).
"""
from __future__ import annotations

import os
import tempfile
import threading
import uuid
from multiprocessing.connection import Client, Listener
from typing import Iterable, Sequence

import torch

from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import FlatBucket, announced, check_bucket


class IpcSender:
    """Trainer side of the IPC transport to an engine whose vLLM core is a child process."""

    keeps_buffers = True  # the worker's reload may hold a layer's views until the layer is complete
    shares_buffers = True

    def __init__(self, engine, *, local_rank: int = 0, address_template: str | None = None):
        self.engine = engine
        self.local_rank = local_rank
        self.address_template = address_template or os.path.join(
            tempfile.gettempdir(), f"megarl-ipc-{uuid.uuid4().hex[:12]}-{{rank}}.sock")
        self.authkey = os.urandom(16)
        self._announced = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced = None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Hand every bucket to the engine's workers by handle; returns the engine's version after it."""
        checked = (check_bucket(b, self._announced) for b in buckets)
        return serve_buckets(self.address_template, self.local_rank, self.authkey, checked,
                             lambda: self.engine.load_by_ipc(self.address_template, self.authkey, version))


def serve_buckets(address_template: str, local_rank: int, authkey: bytes, buckets: Iterable[FlatBucket], receive):
    """Listen, run `receive()` (which makes the workers connect and load) on a thread, feed it the buckets.

    Returns what `receive()` returned; re-raises what it raised.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    address = address_template.format(rank=local_rank)
    result: dict = {}

    def run():
        try:
            result["value"] = receive()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the sending thread
            result["error"] = exc

    with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        with listener.accept() as conn:
            for bucket in buckets:
                conn.send((reduce_tensor(bucket.buffer), bucket.entries))
                if conn.recv() != "ok":  # the worker has taken the bucket's views
                    raise RuntimeError("vLLM worker did not acknowledge a weight bucket")
            conn.send(None)
        worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def receive_buckets(conn) -> Iterable[FlatBucket]:
    """Worker side: the buckets sent by `serve_buckets` until it sends None (acknowledging each)."""
    while (message := conn.recv()) is not None:
        (rebuild, args), entries = message
        yield FlatBucket(rebuild(*args), tuple(entries))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        conn.send("ok")


class MegarlWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called with `collective_rpc`."""

    def megarl_reload_by_ipc(self, address_template: str, authkey: bytes) -> int:
        """Receive buckets from the trainer on this worker's device until it sends None; load them in one reload."""
        from megarl.rollout.vllm_patches import repack_after_reload

        rank = getattr(self, "local_rank", 0)
        names: list[str] = []
        with Client(address_template.format(rank=rank), family="AF_UNIX", authkey=authkey) as conn:
            def stream():
                for bucket in receive_buckets(conn):
                    for name, tensor in bucket.tensors():
                        names.append(name)
                        yield name, tensor

            self.reload_weights(weights_iterator=stream())
        repack_after_reload(self, names)
        return len(names)
