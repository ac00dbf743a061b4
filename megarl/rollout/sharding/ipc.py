"""IPC transport: vLLM workers in other processes map each bucket instead of copying it.

Owns: `IpcSender` (trainer side; a `Sender`), `serve_buckets` / `receive_buckets` (the two ends of
one update) and `MegarlWorkerExtension` (mixed into vLLM's workers with `worker_extension_cls`;
`VLLMEngine` sets it). Per `FlatBucket` the trainer sends
`torch.multiprocessing.reductions.reduce_tensor` of the bucket's buffer as it is — a CUDA IPC
handle on GPU (the worker opens the same memory), a shared-memory handle on CPU (the sharding
manager allocates the buffer in shared memory: `Sender.shares_buffers`) — plus the entries (name,
shape, offset) and (`verify`, on by default) its per-tensor checksums (`protocol.checksums`), over a
`multiprocessing.connection` to every vLLM worker of the engine: nothing is flattened, concatenated or
re-bucketed on the way, and the next bucket is gathered while the workers load this one. Each worker
rebuilds the tensor, checks its checksums (so a buffer the trainer reused or freed too early, or a
handle that maps the wrong memory, fails the update naming the tensor instead of loading wrong
weights) and loads views of it. A CPU engine's linears keep plain weights (`vllm_patches`, fix 3):
the model's weight loaders copy the views into its parameters (each takes the worker's TP slice).
Otherwise (GPU, packed CPU kernels, MoE experts) the views stream into ONE `reload_weights` call
(vLLM's layer-wise reload must see a layer's tensors within one call), after which the worker applies
the vLLM re-pack fixes. vLLM's reload may keep a layer's views until the layer is complete, and the
sender gathers the next bucket while the workers load this one, so every bucket has a buffer of its
own within an update (`Sender.keeps_buffers`).

With rollout TP > 1 all `engine.ipc_workers` workers connect to the one listener of the engine's
host rank and each takes every bucket (a worker on another GPU opens the CUDA handle on the
device it names: the sender's GPU, found by UUID among the worker's visible devices, which for a
colocated engine include the host rank's GPU). A failure on either side ends the update on both
(a worker that never connects does not leave the sender waiting): `serve_buckets` raises, and the
engine decides what the failure means (`UpdateProgress`: had a bucket been handed over yet?).
Tested on CPU (shared memory); the CUDA path is the same code with CUDA tensors.

Must not import the vLLM engine module (`vllm_engine.py`): the engine is duck-typed
(`check_update`, `load_by_ipc`, `ipc_workers`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid
from multiprocessing.connection import Client, Listener
from typing import Iterable, Optional, Sequence

import torch

from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import (
    FlatBucket,
    UpdateProgress,
    announced,
    check_bucket,
    checksums,
    verify_bucket,
)
from megarl.rollout.vllm_patches import apply_in_vllm_process, loads_in_place, repack_after_reload

_HELLO = "megarl-worker"


class IpcSender:
    """Trainer side of the IPC transport to an engine whose vLLM workers are other processes."""

    keeps_buffers = True  # the worker's reload may hold a layer's views until the layer is complete
    shares_buffers = True

    def __init__(self, engine, *, address: Optional[str] = None, verify: bool = True):
        self.engine, self.verify = engine, verify
        self.workers = int(getattr(engine, "ipc_workers", 1))
        self.address = address or os.path.join(tempfile.gettempdir(), f"megarl-ipc-{uuid.uuid4().hex[:12]}.sock")
        self.authkey = os.urandom(16)
        self._announced = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced = None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Hand every bucket to the engine's workers by handle; returns the engine's version after it."""
        checked = (check_bucket(b, self._announced) for b in buckets)
        progress = UpdateProgress()
        return serve_buckets(
            self.address,
            self.authkey,
            checked,
            lambda: self.engine.load_by_ipc(self.address, self.authkey, version, progress),
            workers=self.workers,
            progress=progress,
            verify=self.verify,
        )


def serve_buckets(
    address: str,
    authkey: bytes,
    buckets: Iterable[FlatBucket],
    receive,
    *,
    workers: int = 1,
    progress: Optional[UpdateProgress] = None,
    verify: bool = True,
):
    """Listen, run `receive()` (which makes `workers` workers connect and load) on a thread, feed them the buckets.

    Returns what `receive()` returned. A failure of `receive()` is raised as it is; a failure on
    this side (the buckets, a worker gone) is raised after `receive()` has ended too.
    """
    progress = progress or UpdateProgress()
    result: dict = {}
    with Listener(address, family="AF_UNIX", authkey=authkey) as listener:

        def run():
            try:
                result["value"] = receive()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the sending thread
                result["error"] = exc
                _wake_listener(address)  # a sender still waiting for workers stops waiting

        thread = threading.Thread(target=run, name="megarl-ipc-receive", daemon=True)
        thread.start()
        conns: list = []
        try:
            _feed(listener, conns, workers, buckets, progress, verify)
        except BaseException as exc:  # noqa: BLE001 - the receive side's error, when there is one, is the cause
            result.setdefault("send_error", exc)
        finally:
            for conn in conns:
                conn.close()  # workers still reading see the end and fail; receive() then returns
            thread.join()
    if "error" in result:
        raise result["error"]
    if "send_error" in result:
        raise result["send_error"]
    return result["value"]


def _feed(
    listener, conns: list, workers: int, buckets: Iterable[FlatBucket], progress: UpdateProgress, verify: bool
) -> None:
    for _ in range(workers):
        conn = listener.accept()
        conns.append(conn)
        if conn.recv() != _HELLO:
            raise RuntimeError("an IPC peer that is not a megarl worker connected")
    pending = iter(buckets)
    message = _message(next(pending, None), verify)
    while message is not None:
        progress.touched = True  # from here a worker may hand tensors of this bucket to the model
        for conn in conns:
            conn.send(message)
        # The next bucket is gathered and checksummed while the workers load this one (every bucket
        # has a buffer of its own within an update: `IpcSender.keeps_buffers`); if that fails, the
        # workers still finish this one before they see the connection end.
        try:
            message = _message(next(pending, None), verify)
        finally:
            for conn in conns:
                if conn.recv() != "ok":  # the worker has taken the bucket's views
                    raise RuntimeError("a vLLM worker did not acknowledge a weight bucket")
    for conn in conns:
        conn.send(None)


def _message(bucket: Optional[FlatBucket], verify: bool):
    """What travels for one bucket: its buffer's handle, entries, device and (`verify`) checksums."""
    from torch.multiprocessing.reductions import reduce_tensor

    if bucket is None:
        return None
    sums = checksums(bucket).tolist() if verify else None
    return reduce_tensor(bucket.buffer), bucket.entries, _device_uuid(bucket.buffer), sums


def _wake_listener(address: str) -> None:
    """Connect once and hang up, so an `accept` still waiting for workers returns (its handshake fails);
    a connection nobody accepts any more just sits in the closed listener's backlog."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        try:
            sock.connect(address)
        except OSError:  # the listener is already closed: nobody waits
            pass


def connect_worker(address: str, authkey: bytes):
    """Worker side: a connection to the sender, announced (pass it to `receive_buckets`)."""
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(_HELLO)
    return conn


def receive_buckets(conn) -> Iterable[FlatBucket]:
    """Worker side: the buckets sent by `serve_buckets` until it sends None (acknowledging each), each
    checked against its checksums when they came with it."""
    while (message := conn.recv()) is not None:
        (rebuild, args), entries, device_uuid, sums = message
        if device_uuid is not None:
            args = _on_visible_device(rebuild, args, device_uuid)
        bucket = FlatBucket(rebuild(*args), tuple(entries))
        yield bucket if sums is None else verify_bucket(bucket, torch.tensor(sums, dtype=torch.int64))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        conn.send("ok")


def _device_uuid(tensor: torch.Tensor) -> Optional[str]:
    return str(torch.cuda.get_device_properties(tensor.device).uuid) if tensor.is_cuda else None


def _on_visible_device(rebuild, args: tuple, device_uuid: str) -> tuple:
    """`rebuild_cuda_tensor`'s arguments with the device renumbered: the sender numbers GPUs by its own
    CUDA_VISIBLE_DEVICES, the worker by its own; the UUID names the same GPU in both."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if rebuild is not rebuild_cuda_tensor:
        return args
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return args[:6] + (index,) + args[7:]  # args[6] is the storage's device index
    raise RuntimeError(
        f"a weight bucket lives on GPU {device_uuid}, which this vLLM worker does not see: its"
        " CUDA_VISIBLE_DEVICES must include the GPU of the trainer rank that hosts the engine"
    )


class MegarlWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called with `collective_rpc`."""

    def megarl_loads_in_place(self) -> bool:
        """Whether an update is copied straight into this worker's parameters (`vllm_patches.loads_in_place`)."""
        return loads_in_place(self.get_model())

    def megarl_reload_by_ipc(self, address: str, authkey: bytes) -> int:
        """Receive buckets from the trainer until it sends None; load them (this worker's slice): in place into
        plain CPU weights, otherwise in one `reload_weights` call."""
        names: list[str] = []
        in_place = loads_in_place(self.get_model())
        with connect_worker(address, authkey) as conn:

            def stream():
                for bucket in receive_buckets(conn):
                    for name, tensor in bucket.tensors():
                        names.append(name)
                        yield name, tensor

            if in_place:  # plain CPU weights (`plain_cpu_linear_weights`): the model's loaders copy into them
                from vllm.config import set_current_vllm_config

                with set_current_vllm_config(self.vllm_config), torch.inference_mode():
                    self.get_model().load_weights(stream())
            else:
                self.reload_weights(weights_iterator=stream())
        if not in_place:
            repack_after_reload(self, names)
        return len(names)


# vLLM imports this module in each of its workers (the worker extension) before it loads the model: a
# worker of a CPU engine started by megarl keeps plain linear weights (vllm_patches, fix 3)
apply_in_vllm_process()
