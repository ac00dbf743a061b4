"""IPC transport: a colocated vLLM worker in another process maps each bucket instead of copying it.

Owns: `IpcSender` (trainer side) and `MegarlWorkerExtension` (mixed into vLLM's workers with
`worker_extension_cls`; `VLLMEngine` sets it). Per bucket the trainer flattens the bucket's HF
tensors into one buffer on its device and sends `torch.multiprocessing.reductions.reduce_tensor`
of it — a CUDA IPC handle on GPU (the worker opens the same memory, no copy over any wire), a
shared-memory handle on CPU — plus the names and shapes, over a `multiprocessing.connection` to
the worker; the worker rebuilds the tensor, streams views of it into ONE `reload_weights` call
(vLLM's layer-wise reload must see a layer's tensors within one call) and acknowledges, after
which the trainer frees the buffer. Peak extra memory: one bucket.

With several vLLM workers (rollout TP > 1, one per GPU), each worker connects to the listener
whose address is `address_template.format(rank=<worker's local rank>)`, i.e. the trainer rank on
its own GPU; every rollout rank of the sharding manager holds the full bucket (vLLM's weight
loaders slice it for their TP rank). Tested on CPU (shared memory, in-process vLLM); the CUDA path
is the same code with CUDA tensors and has not run here.
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


class IpcSender:
    """Trainer side of the IPC transport to a `VLLMEngine` (use as `ShardingManager.sync(sender=...)`)."""

    def __init__(self, engine, *, local_rank: int = 0, address_template: str | None = None):
        self.engine = engine
        self.local_rank = local_rank
        self.address_template = address_template or os.path.join(
            tempfile.gettempdir(), f"megarl-ipc-{uuid.uuid4().hex[:12]}-{{rank}}.sock")
        self.authkey = os.urandom(16)

    def bind_plan(self, plan) -> "IpcSender":
        return self

    def check_update(self, specs: Sequence[HFSpec]) -> None:
        self._specs = list(specs)
        self.engine.check_update(self._specs)

    def send(self, plan, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """Hand every bucket to the engine's workers; returns the engine's new version."""
        return serve_buckets(self.address_template, self.local_rank, self.authkey, map(flatten, buckets),
                             lambda: self.engine.update_weights_by_ipc(self.address_template, self.authkey,
                                                                       specs=self._specs))


def flatten(tensors: list[tuple[str, torch.Tensor]]):
    """(one flat buffer, [(name, shape)]) of a bucket of same-dtype tensors."""
    return torch.cat([t.reshape(-1) for _, t in tensors]), [(name, tuple(t.shape)) for name, t in tensors]


def serve_buckets(address_template: str, local_rank: int, authkey: bytes, buckets, receive):
    """Listen, run `receive()` (which makes the workers connect and load) on a thread, feed it the buckets.

    buckets: iterable of (flat buffer, [(name, shape)]).

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
            for flat, layout in buckets:
                conn.send((reduce_tensor(flat), layout))
                if conn.recv() != "ok":  # the worker has copied the bucket; the buffer may go
                    raise RuntimeError("vLLM worker did not acknowledge a weight bucket")
                del flat
            conn.send(None)
        worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def rebucket(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """(flat, layout) buckets of ≤ bucket_bytes (one dtype each) from a stream of tensors.

    Each tensor is copied into the bucket's buffer as it arrives, so the stream may reuse its
    tensors' memory afterwards (the sharding manager's are valid only until the next bucket).
    """
    flat, layout, used = None, [], 0
    for name, tensor in weights:
        numel = tensor.numel()
        if flat is not None and (used + numel > flat.numel() or tensor.dtype != flat.dtype):
            yield flat[:used], layout
            flat, layout, used = None, [], 0
        if flat is None:
            capacity = max(numel, bucket_bytes // tensor.element_size())
            flat = torch.empty(capacity, dtype=tensor.dtype, device=tensor.device)
        flat[used:used + numel].view(tensor.shape).copy_(tensor)
        layout.append((name, tuple(tensor.shape)))
        used += numel
    if flat is not None:
        yield flat[:used], layout


class MegarlWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called with `collective_rpc`."""

    def megarl_reload_by_ipc(self, address_template: str, authkey: bytes) -> int:
        """Receive buckets from the trainer on this worker's device until it sends None; load them in one reload."""
        rank = getattr(self, "local_rank", 0)
        count, names = 0, []
        with Client(address_template.format(rank=rank), family="AF_UNIX", authkey=authkey) as conn:
            def stream():
                nonlocal count
                while (message := conn.recv()) is not None:
                    (rebuild, args), layout = message
                    flat = rebuild(*args)
                    offset = 0
                    for name, shape in layout:
                        numel = torch.Size(shape).numel()
                        names.append(name)
                        yield name, flat[offset:offset + numel].view(shape)
                        offset += numel
                        count += 1
                    del flat
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    conn.send("ok")

            self.reload_weights(weights_iterator=stream())
        from megarl.rollout.vllm_engine import repack_cpu_moe_experts, repack_tied_lm_head

        repack_tied_lm_head(self)
        repack_cpu_moe_experts(self, names)
        return count
