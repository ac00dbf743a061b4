"""IPC transport: vLLM workers in other processes map each bucket instead of copying it.

Owns: `IpcSender` (trainer side; a `Sender`), `IpcChannel` (the sender's end, kept from update to
update), `receive_buckets` (the worker's end of one update), `serve_buckets` (one update over a channel
of its own) and `MegarlWorkerExtension` (mixed into vLLM's workers with `worker_extension_cls`;
`VLLMEngine` sets it). Per `FlatBucket` the trainer sends
`torch.multiprocessing.reductions.reduce_tensor` of the memory holding the bucket's buffer as it is —
a CUDA IPC handle on GPU (the worker opens the same memory), a shared-memory handle on CPU (the
sharding manager allocates the buffer in shared memory: `Sender.shares_buffers`) — plus where the
bucket lies in it, the entries (name, shape, offset) and (`verify`, on by default) its per-tensor
checksums (`protocol.checksums`; its writers', `writesums`, where they took them), over a
`multiprocessing.connection` to every vLLM worker of the
engine: nothing is flattened, concatenated or re-bucketed on the way, and the next bucket is
gathered while the workers load this one. The connections stay open from update to update, and a
buffer the manager keeps between syncs (`FlatBucket.kept`: host memory) crosses by handle once: later
updates name it by a token and the worker reads it through the mapping it already has. Each worker
rebuilds the tensor, checks its checksums (so a buffer the trainer reused or freed too early, or a
handle that maps the wrong memory, fails the update naming the tensor instead of loading wrong
weights) and loads views of it: for `reload_weights`, the whole bucket before any of it is loaded; in
place, each tensor before its loader gets it, or, where the worker replays its loaders' copies
(`load_plan`), as the copy is made (`copysum`: one pass over the bytes instead of two; a corrupted
tensor is then found once it is in the model, and the update fails as one that had begun loading;
any IPC update counts as begun from its first bucket, `UpdateProgress`). A bucket that came with
checksums (an engine server's, received by broadcast: `FlatBucket.expected`) crosses with those, not
with new ones: its workers check the trainer's sums. A CPU engine's linears keep plain weights (`vllm_patches`, fix 3):
the model's weight loaders copy the views into its parameters (each takes the worker's TP slice); from
the third update with the same tensors on, the copies they made are replayed without them (`load_plan`).
With `IpcSender(adopt=True)` (the rollout worker's) the buckets land in shared memory the sender keeps for
its engine alone, and after the first whole replay the worker takes them as its parameters
(`ReplayingLoader.adopt`, TP 1): the ranks then write every later update straight into the model, and the
worker only checks it. Such an update counts as begun from its start.
Otherwise (GPU, packed CPU kernels, MoE experts) the views stream into ONE `reload_weights` call
(vLLM's layer-wise reload must see a layer's tensors within one call), after which the worker applies
the vLLM re-pack fixes. vLLM's reload may keep a layer's views until the layer is complete, and the
sender gathers the next bucket while the workers load this one, so every bucket has a buffer of its
own within an update (`Sender.keeps_buffers`).

With rollout TP > 1 all `engine.ipc_workers` workers connect to the one listener of the engine's
host rank and each takes every bucket (a worker on another GPU opens the CUDA handle on the
device it names: the sender's GPU, found by UUID among the worker's visible devices, which for a
colocated engine include the host rank's GPU). A failure on either side ends the update on both
(a worker that never connects or answers does not leave the sender waiting) and closes the channel
(the next update opens a new one): `IpcChannel.serve` raises, and the engine decides what the
failure means (`UpdateProgress`: had a bucket been handed over yet?).
Tested on CPU (shared memory); the CUDA path is the same code with CUDA tensors, run on one GPU by
`benchmarks/ipc_device.py` (`scripts/gpu_check.sh`). There a buffer mapped earlier is announced only once
the sender's stream has written it (`_written`).

Must not import the vLLM engine module (`vllm_engine.py`): the engine is duck-typed
(`check_update`, `load_by_ipc`, `ipc_workers`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import tempfile
import threading
import uuid
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Client, Listener, wait
from typing import Iterable, Iterator, Optional, Sequence

import torch

from megarl.rollout.load_plan import ReplayingLoader
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import (
    FlatBucket,
    UpdateProgress,
    announced,
    check_bucket,
    check_in_place,
    checksums,
    corruption_first,
    verify_bucket,
)
from megarl.rollout.sharding.transport import KeptBuffers, adoption_enabled
from megarl.rollout.vllm_patches import apply_in_vllm_process, loads_in_place, repack_after_reload

_HELLO = "megarl-worker"
_END = "megarl-end"  # an update's last message: (_END, the tokens of the kept buffers still in use)


class IpcSender:
    """Trainer side of the IPC transport to an engine whose vLLM workers are other processes.

    Its `IpcChannel` (listener, the workers' connections, the buffers they have mapped) is kept from
    update to update; a failed update closes it on both sides, and the next one opens a new one.
    """

    keeps_buffers = True  # the worker's reload may hold a layer's views until the layer is complete
    shares_buffers = True

    def __init__(self, engine, *, address: Optional[str] = None, verify: bool = True, adopt: bool = False):
        self.engine, self.verify = engine, verify
        self.workers = int(getattr(engine, "ipc_workers", 1))
        self.address, self.authkey = address or _fresh_address(), os.urandom(16)
        self._channel: Optional[IpcChannel] = None
        self._announced = None
        # `adopt` (a sharding manager's syncs): the buckets land in shared memory this sender keeps for its
        # engine alone (`adopt_into`, set by `check`), which the engine's CPU workers may take as their
        # parameters (`load_plan.ReplayingLoader.adopt`): later syncs are written straight into the model
        # (`MEGARL_ADOPT_WEIGHTS=0`: never; the workers then copy every update in)
        self.buffers = KeptBuffers() if adopt and adoption_enabled() else None
        self.adopt_into: Optional[KeptBuffers] = None

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        self._announced, self.adopt_into = None, None
        self.engine.check_update(specs, partial=partial)
        self._announced = announced(specs)
        if self.buffers is not None and not partial:
            self.adopt_into = self.buffers

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Hand every bucket to the engine's workers by handle; returns the engine's version after it."""
        checked = (check_bucket(b, self._announced) for b in buckets)
        if self._channel is not None and self._channel.closed:  # the last update failed: listen somewhere new
            self._channel, self.address, self.authkey = None, _fresh_address(), os.urandom(16)
        if self._channel is None:
            self._channel = IpcChannel(self.address, self.authkey, self.workers)
        progress = UpdateProgress()
        owned = self.adopt_into
        if owned is not None:  # the ranks write into buffers the model may live in: touched from the start
            progress.touched = True
        return self._channel.serve(
            checked,
            lambda: self.engine.load_by_ipc(self.address, self.authkey, version, progress),
            progress=progress,
            verify=self.verify,
            owned=owned,
        )


class IpcChannel:
    """The sender's end of the IPC transport, kept from update to update.

    Holds the listener, the `workers` connections of the engine's workers (made during the first update,
    kept by both sides after it: later updates need no connect and handshake) and which kept buffers
    (`FlatBucket.kept`) the workers have mapped: such a buffer crosses by handle once, afterwards by a
    token, and the worker's mapping, its page tables included, is reused. Each update ends with the
    tokens still in use; the workers drop their other mappings. Any failure closes the channel on both
    sides (`serve` raises): the next update starts over with a new one.
    """

    def __init__(self, address: str, authkey: bytes, workers: int = 1):
        self.address, self.authkey, self.workers = address, authkey, workers
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.conns: list = []
        self.mapped: dict[int, tuple[weakref.ref, int]] = {}  # storage address → (its storage, token)
        self._tokens = itertools.count()
        self._wake_r, self._wake_w = Pipe(duplex=False)  # the receive side ended: stop waiting for workers
        self._finalizer = weakref.finalize(self, _close_all, self.listener, self.conns, self._wake_r, self._wake_w)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self.mapped.clear()
        self._finalizer()

    def serve(
        self,
        buckets: Iterable[FlatBucket],
        receive,
        *,
        progress: Optional[UpdateProgress] = None,
        verify: bool = True,
        owned: Optional[KeptBuffers] = None,
    ):
        """Run `receive()` (which makes the workers connect, or reuse their connection, and load) on a
        thread and feed them the buckets; what `receive()` returned. `owned`: the buffers kept for this
        engine alone (`IpcSender.adopt_into`); a bucket in them is marked as one its workers may adopt.

        A failure of `receive()` is raised as it is; a failure on this side (the buckets, a worker
        gone) is raised after `receive()` has ended too. Either closes the channel.
        """
        progress = progress or UpdateProgress()
        result: dict = {}
        while self._wake_r.poll():  # the previous update's end
            self._wake_r.recv()

        def run():
            try:
                result["value"] = receive()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the sending thread
                result["error"] = exc
                _wake_listener(self.address)  # a sender still waiting for workers to connect stops waiting
            finally:
                with contextlib.suppress(OSError):  # closed already when this side failed first
                    self._wake_w.send(None)  # ... or for a worker's message

        thread = threading.Thread(target=run, name="megarl-ipc-receive", daemon=True)
        thread.start()
        try:
            self._feed(buckets, progress, verify, owned)
        except BaseException as exc:  # noqa: BLE001 - the receive side's error, when there is one, is the cause
            result.setdefault("send_error", exc)
            self.close()  # workers still reading see the end and fail; receive() then returns
        finally:
            thread.join()
        if "error" in result or "send_error" in result:
            self.close()
            raise result.get("error", result.get("send_error"))
        return result["value"]

    def _feed(
        self, buckets: Iterable[FlatBucket], progress: UpdateProgress, verify: bool, owned: Optional[KeptBuffers]
    ) -> None:
        for conn in self.conns:  # kept from an earlier update: each worker announces every update
            if self._recv(conn) != _HELLO:
                raise RuntimeError("a vLLM worker did not announce the update")
        while len(self.conns) < self.workers:
            self.conns.append(self.listener.accept())
            if self._recv(self.conns[-1]) != _HELLO:
                raise RuntimeError("an IPC peer that is not a megarl worker connected")
        pending, live = iter(buckets), []
        message = self._message(next(pending, None), verify, live, owned)
        while message is not None:
            progress.touched = True  # from here a worker may hand tensors of this bucket to the model
            for conn in self.conns:
                conn.send(message)
            # The next bucket is gathered and checksummed while the workers load this one (every bucket
            # has a buffer of its own within an update: `IpcSender.keeps_buffers`); if that fails, the
            # workers still finish this one before they see the connection end.
            try:
                message = self._message(next(pending, None), verify, live, owned)
            finally:
                for conn in self.conns:
                    if self._recv(conn) != "ok":  # the worker has taken the bucket's views
                        raise RuntimeError("a vLLM worker did not acknowledge a weight bucket")
        for conn in self.conns:
            conn.send((_END, live))
        self.mapped = {ptr: known for ptr, known in self.mapped.items() if known[1] in live}

    def _recv(self, conn):
        """The worker's next message; raises when the receive side ended first (its error is the one raised)."""
        if self._wake_r in wait([conn, self._wake_r]) and not conn.poll():
            raise RuntimeError("the engine's reload ended before the update was complete")
        return conn.recv()

    def _message(self, bucket: Optional[FlatBucket], verify: bool, live: list, owned: Optional[KeptBuffers] = None):
        """What travels for one bucket: its buffer (a handle, or the token of a buffer the workers have
        mapped), where the bucket lies in it, its entries, device, (`verify`) checksums and whether it lies in
        buffers kept for this engine alone (`owned`)."""
        from torch.multiprocessing.reductions import reduce_tensor

        if bucket is None:
            return None
        if bucket.expected is not None:  # checksums that came with the bucket (an engine server's IPC hop)
            source = bucket.expected  # are the workers' to check: end to end, none taken again here
        elif not verify:
            source = None
        else:  # the sums its writers took as they wrote it (`writesums`), else taken here
            source = bucket.sums if bucket.sums is not None else checksums(bucket)
        sums = None if source is None else source.tolist()  # from the GPU: waits for its stream
        buffer = bucket.buffer
        storage = buffer.untyped_storage()
        known = self.mapped.get(storage.data_ptr()) if bucket.kept else None
        if known is not None and known[0]() is storage:
            handle, token = None, known[1]
        else:
            whole = torch.empty(0, dtype=torch.uint8, device=buffer.device).set_(storage)
            handle, token = reduce_tensor(whole), (next(self._tokens) if bucket.kept else None)
            if token is not None:
                self.mapped[storage.data_ptr()] = (weakref.ref(storage), token)
        if token is not None:
            live.append(token)
        if handle is None and buffer.is_cuda and (source is None or source.device != buffer.device):
            _written(buffer)
        where = (buffer.storage_offset() * buffer.element_size(), buffer.numel(), buffer.dtype)
        adoptable = bucket.kept and owned is not None and owned.holds(buffer)
        return handle, token, where, bucket.entries, _device_uuid(buffer), sums, adoptable


def _written(buffer: torch.Tensor) -> None:
    """Wait until the GPU has written a bucket named by token before the workers are told to read it.

    A CUDA IPC handle carries an event of the sender's stream, which the worker waits for when it opens
    the handle; a buffer mapped in an earlier update crosses by token, with no event, and checksums read
    back from the GPU (`.tolist()`) wait for the stream anyway: so a kept CUDA buffer sent unverified (or
    with sums taken elsewhere) gets here.
    Without it the worker may read the bucket while the copies into it are still running (the previous
    update's bytes: `benchmarks/ipc_device.py` checks this)."""
    torch.cuda.current_stream(buffer.device).synchronize()


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
    """One update over a channel of its own (`IpcChannel.serve`), closed after it."""
    channel = IpcChannel(address, authkey, workers)
    try:
        return channel.serve(buckets, receive, progress=progress, verify=verify)
    finally:
        channel.close()


def _close_all(listener, conns: list, *pipes) -> None:
    for conn in conns:
        conn.close()  # workers still reading see the end
    conns.clear()
    listener.close()
    for pipe in pipes:
        pipe.close()


def _fresh_address() -> str:
    return os.path.join(tempfile.gettempdir(), f"megarl-ipc-{uuid.uuid4().hex[:12]}.sock")


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


def receive_buckets(conn, mapped: Optional[dict] = None) -> Iterable[FlatBucket]:
    """Worker side: the buckets `IpcChannel.serve` sends until the update's end (acknowledging each), each
    checked against its checksums when they came with it.

    `mapped`: token → buffer of the kept buffers mapped in earlier updates over this connection (kept
    by the caller with the connection); updated here, and left holding the ones still in use.
    """
    mapped = {} if mapped is None else mapped
    while (message := conn.recv())[0] != _END:
        handle, token, (offset, numel, dtype), entries, device_uuid, sums, adoptable = message
        if handle is not None:
            rebuild, args = handle
            if device_uuid is not None:
                args = _on_visible_device(rebuild, args, device_uuid)
            whole = rebuild(*args)
            if token is not None:
                mapped[token] = whole
        else:
            whole = mapped[token]
        buffer = whole[offset : offset + numel * dtype.itemsize].view(dtype)
        bucket = FlatBucket(buffer, tuple(entries), kept=adoptable)
        yield bucket if sums is None else verify_bucket(bucket, torch.tensor(sums, dtype=torch.int64))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        conn.send("ok")
    for token in set(mapped) - set(message[1]):
        del mapped[token]


def loader_tensors(bucket: FlatBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of a received bucket for a worker's weight loaders: on a GPU its checksums are compared
    after the loaders have queued their copies (`FlatBucket.tensors_checked_after`); on CPU, where the sums
    are a read the worker waits for either way, checked first (a corrupted bucket then loads nothing)."""
    return bucket.tensors_checked_after() if bucket.buffer.is_cuda else iter(bucket.tensors())


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
        return self._megarl_in_place() is not None

    def megarl_adopted_bytes(self) -> int:
        """Parameter bytes of this worker that live in the sender's buffers (`load_plan.ReplayingLoader.adopt`)."""
        loader = self._megarl_in_place()
        if loader is None:
            return 0
        params = dict(self.get_model().named_parameters())
        return sum(params[n].numel() * params[n].element_size() for n in loader.adopted)

    def megarl_replayed_tensors(self) -> int:
        """How many update tensors this worker loaded by replaying its loaders' copies (`load_plan`)."""
        loader = self._megarl_in_place()
        return loader.replayed if loader is not None else 0

    def megarl_reload_by_ipc(self, address: str, authkey: bytes) -> int:
        """Receive buckets from the trainer until the update's end; load them (this worker's slice): in place
        into plain CPU weights, otherwise in one `reload_weights` call.

        The connection to the sender and the kept buffers mapped over it stay for the next update to the
        same address; a failure drops both (the sender closes its side too)."""
        names: list[str] = []
        in_place = self._megarl_in_place()
        conn, mapped = self._megarl_channel(address, authkey)
        buckets = receive_buckets(conn, mapped)
        owned = [True]  # every bucket lay in buffers the sender keeps for this engine alone
        current: list[Optional[FlatBucket]] = [None]  # the bucket being loaded, until its checks are done
        try:

            def stream():  # in place: (name, view, its pending check); each tensor checked as it is copied
                for bucket in buckets:  # (adopted ones: together once the loader is done with the bucket)
                    owned[0] &= bucket.kept
                    current[0] = bucket
                    adopted: list[int] = []
                    for item in bucket.pending(adopted) if in_place else loader_tensors(bucket):
                        names.append(item[0])
                        yield item
                    check_in_place(bucket, adopted)  # before the next bucket: its sender may reuse this one's memory
                    current[0] = None  # checked whole: from the next pull on its memory may hold other bytes

            items = stream()
            if in_place:  # plain CPU weights (`plain_cpu_linear_weights`): the model's loaders copy into them
                from vllm.config import set_current_vllm_config

                with set_current_vllm_config(self.vllm_config), torch.inference_mode():
                    in_place.load_checked(self.get_model().load_weights, items)
            else:
                self.reload_weights(weights_iterator=items)
            # the update's end must be read here, not by the next update; draining `items` (not `buckets`) runs
            # the last bucket's deferred checks (check_in_place, tensors_checked_after's compare) first
            if next(items, None) is not None:
                raise RuntimeError("the model's weight loading stopped before the update's last tensor")
            if in_place and owned[0]:  # from the next update on the ranks write into the model (`adopt`)
                in_place.adopt()
        except BaseException as err:
            self._megarl_ipc = None
            try:
                corruption_first(current[0], err)  # before the sender hears of it: the bucket is still this update's
            finally:
                conn.close()
            raise
        if not in_place:
            repack_after_reload(self, names)
        return len(names)

    def _megarl_in_place(self) -> Optional[ReplayingLoader]:
        """The loader of in-place updates (`load_plan`), when the model takes them; looked up once per model."""
        model = self.get_model()
        kept = getattr(self, "_megarl_loader", None)
        if kept is None or kept[0] is not model:
            loader = ReplayingLoader(model.named_parameters) if loads_in_place(model) else None
            self._megarl_loader = kept = (model, loader)
        return kept[1]

    def _megarl_channel(self, address: str, authkey: bytes):
        """(connection, mapped kept buffers) for this sender: the kept ones, else a new connection."""
        kept = getattr(self, "_megarl_ipc", None)
        if kept is not None and kept[0] == address:
            kept[1].send(_HELLO)
            return kept[1], kept[2]
        if kept is not None:  # a new sender (the last one failed or went): its buffers go too
            kept[1].close()
        self._megarl_ipc = (address, connect_worker(address, authkey), {})
        return self._megarl_ipc[1], self._megarl_ipc[2]


# vLLM imports this module in each of its workers (the worker extension) before it loads the model: a
# worker of a CPU engine started by megarl keeps plain linear weights (vllm_patches, fix 3)
apply_in_vllm_process()
