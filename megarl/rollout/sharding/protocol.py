"""The weight-sync protocol: what travels (`FlatBucket`) and who moves it (`Sender`).

Owns: `FlatBucket` (one flat contiguous buffer plus the (HF name, shape, offset) of every tensor
in it, each a contiguous slice, in order), the `Sender` contract every transport implements,
`WeightUpdateError`, `UpdateProgress` (whether a failing update had reached the model yet), and
the helpers all senders share: `bucket_tensors` (a list of HF tensors → flat buckets, the one
bucketing of tensors that do not come from the sharding manager),
`check_bucket` (a bucket against the announced specs), `alloc_flat` (fresh, optionally
shared-memory buffers, their pages reserved at once: no room in /dev/shm is a MemoryError, not a
SIGBUS) and the integrity check of transports that move bytes (`checksums` on the trainer's side,
`verify_bucket` on the engine's: a received bucket carries the sums until its tensors are taken;
`PendingCheck`, one tensor's, for a consumer that checks as it copies: `pending_tensors`; `corruption_first`, for
a consumer that failed before a deferred check ran). Imports torch,
`plan`, `shm`, `copysum` and `devicesum` only (Triton only when a GPU bucket is summed): no engine, no
transport, no vLLM / Ray.

One update, whatever the transport:

    sender.check(specs)               # names/shapes against the engine; WeightUpdateError names the
                                      # first tensor that does not fit, and nothing is loaded
    version = sender.send(buckets, version)   # every FlatBucket, as it is; the engine's version after

`ShardingManager.sync(sender, version)` runs both on a rollout rank (the manager's buckets travel
as they are: never flattened or re-bucketed on the way); `RolloutEngine.update_weights` runs both
with buckets made by `bucket_tensors`. Implementations: `senders.InPlaceSender` (engine in this
process), `ipc.IpcSender` (vLLM engine core in a child process), `broadcast.BroadcastSender`
(engine servers over a weight group); `senders.sender_for(engine)` picks one for an engine.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Optional, Protocol, Sequence

import torch

from megarl.rollout.sharding import copysum, devicesum
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, HFSlot, HFSpec
from megarl.rollout.sharding.shm import free_bytes


class WeightUpdateError(ValueError):
    """A weight update does not fit the engine's model; nothing was loaded."""


@dataclass(frozen=True)
class FlatBucket:
    """HF tensors that travel together: one flat buffer, every tensor a contiguous slice of it, in order."""

    buffer: torch.Tensor
    """1-D, contiguous, one dtype; exactly the tensors' elements (entries cover it without gaps)."""
    entries: tuple[HFSlot, ...]
    """(HF name, shape, element offset) of every tensor, in buffer order."""
    kept: bool = False
    """The buffer is one the producer keeps from sync to sync (`transport.KeptBuffers`: host memory, or an
    engine's own GPU buffers): the same memory in every sync while it is kept, so a transport may map it
    once (`ipc.IpcChannel`) and an engine may take it as its parameters (`EmbeddedEngine.load_buckets`)."""
    expected: Optional[torch.Tensor] = None
    """The sender's per-tensor `checksums` of the bytes, still to be checked (`verify_bucket`): `tensors()`
    checks them before it hands on any view; a transport passing the buffer on passes them on instead."""
    sums: Optional[torch.Tensor] = None
    """Its `checksums`, taken by the ranks that wrote the buffer as they wrote it (`writesums`), for a sender
    to send instead of reading the bucket again (`ipc`, `broadcast`); None: not taken."""

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view of the buffer) per entry; no copy. With `expected` checksums, checked first: a
        mismatch raises WeightUpdateError naming the first tensor that differs, and no view is handed on."""
        if self.expected is not None:
            _check(self, self.expected)
        return [(e.name, self._view(e)) for e in self.entries]

    def tensors_checked_after(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`tensors()` for a consumer that only queues copies of them on the bucket's GPU (vLLM's loaders in a
        worker, `ipc.loader_tensors`): the checksums are queued on the device first, every view is handed on
        at once, and the sums are compared when the consumer asks past the last one. The worker's CPU issues
        the loaders' copies while the GPU sums, instead of waiting for the sums first. A mismatch then fails
        the update as one found in the model (an IPC update counts as begun from its first bucket anyway)."""
        if self.expected is None:
            yield from self.tensors()
            return
        got = checksums(self)
        yield from ((e.name, self._view(e)) for e in self.entries)
        _compare(self, got)

    def pending(self, in_place: Optional[list[int]] = None) -> list[tuple[str, torch.Tensor, Optional[PendingCheck]]]:
        """(name, view, its check) per entry, nothing checked yet: for a consumer that checks each tensor itself,
        as it copies it (`load_plan.ReplayingLoader.load_checked`). The check is None without `expected`.
        `in_place`: where the checks of tensors found in the model already put their index
        (`PendingCheck.check_in_place`), for the taker of the bucket to check them together (`check_in_place`)."""
        return [
            (e.name, self._view(e), None if self.expected is None else PendingCheck(self, i, in_place))
            for i, e in enumerate(self.entries)
        ]

    def _view(self, entry: HFSlot) -> torch.Tensor:
        return self.buffer[entry.offset : entry.offset + entry.numel].view(entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype


@dataclass(frozen=True)
class PendingCheck:
    """One tensor of a received bucket (`FlatBucket.pending`) whose sender's checksum is still to be checked."""

    bucket: FlatBucket
    index: int
    later: Optional[list[int]] = field(default=None, compare=False, repr=False)
    """See `check_in_place`."""

    @property
    def name(self) -> str:
        return self.bucket.entries[self.index].name

    def words(self) -> Optional[torch.Tensor]:
        """The int64 words holding exactly the tensor's bytes, whose sum is its checksum (CPU); None where
        its bytes begin or end inside a word (its checksum then covers a neighbour's bytes too)."""
        entry, buffer = self.bucket.entries[self.index], self.bucket.buffer
        size = buffer.element_size()
        start, end = entry.offset * size, (entry.offset + entry.numel) * size
        raw = buffer.view(torch.uint8)
        if buffer.is_cuda or raw.data_ptr() % 8 or start % 8 or end % 8:
            return None
        return raw[start:end].view(torch.int64)

    def copy_into(self, dst: torch.Tensor) -> None:
        """Copy the tensor into `dst` (its shape) and check it: in one pass that sums the bytes as it copies
        them (`copysum`) where `dst` takes them byte for byte (contiguous, the tensor's dtype, on CPU), a
        mismatch then found with the tensor in `dst`; else checked first, then copied."""
        view = self.bucket._view(self.bucket.entries[self.index])
        bytewise = dst.is_contiguous() and dst.dtype == view.dtype and dst.numel() == view.numel()
        words = self.words() if bytewise and dst.device.type == "cpu" and copysum.available() else None
        if words is None:
            self.check()
            dst.copy_(view)
        else:
            self.check(copysum.copy_sum(dst, words), loaded=True)

    def check_in_place(self) -> None:
        """Check the tensor, whose bytes are in the model already (an adopted parameter, which the trainer's ranks
        wrote): now, or, with a `later` list from `FlatBucket.pending(in_place=...)`, when the bucket's taker
        checks all such tensors of the bucket at once (`check_in_place`: one sum for the lot instead of one
        per tensor, ~20 µs each on CPU). A mismatch fails the update either way, as one that reached the model."""
        if self.later is None:
            self.check(loaded=True)
        else:
            self.later.append(self.index)

    def check(self, got: Optional[int] = None, *, loaded: bool = False, more: int = 0) -> None:
        """Raise WeightUpdateError naming the tensor where its checksum differs from the sender's: `got`, its
        words' sum taken while copying it in (`loaded`: it is in the model now), else taken here. `more`: how
        many other tensors of the bucket were found to differ with it (said in the message)."""
        expected = int(self.bucket.expected[self.index])
        if got is None:
            got = int(checksums(FlatBucket(self.bucket.buffer, (self.bucket.entries[self.index],)))[0])
        if got != expected:
            others = f" (and {more} more tensor(s) of its bucket)" if more else ""
            raise WeightUpdateError(
                f"weight bucket corrupted on the way: the bytes of tensor {self.name!r}{others} differ from what"
                " the trainer sent (checksum mismatch); "
                + (
                    "found as it was copied into the model"
                    if loaded
                    else "neither it nor any tensor after it was loaded"
                )
            )


class Sender(Protocol):
    """Moves flat buckets into one engine (or a group of engine servers) and stamps the policy version.

    keeps_buffers: the receiving side may still read a bucket's buffer after the next one was asked
    for (vLLM's layer-wise reload holds a layer's tensors until the layer is complete, and padded
    layers until the end): producers then give every bucket a fresh buffer instead of reusing one.
    shares_buffers: buffers are handed to another process by handle; on CPU they must live in
    shared memory (allocate them with `alloc_flat(..., shared=True)`, or sharing copies them).
    """

    keeps_buffers: bool
    shares_buffers: bool
    # optional: `adopt_into` (set by `check`): buffers of the engine's own in which every bucket must
    # land, the engine then takes them as its parameters (`senders.InPlaceSender`, `ipc.IpcSender`,
    # `broadcast.BroadcastSender`); a producer that cannot land them there sets it to None before `send`

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        """Raise `WeightUpdateError` naming the first tensor the engine(s) cannot take; loads nothing."""

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Load every bucket (only the checked specs may arrive); returns the engine's version after it."""


class UpdateProgress:
    """How far an update got: whether any of its tensors may have reached the model yet.

    A failure before that leaves the engine's weights as they were; after it, they may mix two
    versions (`RolloutEngine.updating` decides what the engine does with that).
    """

    def __init__(self):
        self.touched = False

    def track(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The same stream, marking `touched` as the first tensor is handed on."""
        for item in weights:
            self.touched = True
            yield item


def announced(specs: Sequence[HFSpec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {s.name: (tuple(s.shape), s.dtype) for s in specs}


def check_bucket(bucket: FlatBucket, announced_specs: Optional[dict]) -> FlatBucket:
    """The bucket, if every tensor in it was announced by `check` with its shape and dtype; else raise."""
    if announced_specs is None:
        raise RuntimeError("send() before check(): announce the update's specs with check(specs) first")
    for entry in bucket.entries:
        want = announced_specs.get(entry.name)
        if want is None or want[0] != tuple(entry.shape) or want[1] != bucket.dtype:
            raise WeightUpdateError(
                f"tensor {entry.name!r} ({tuple(entry.shape)}, {bucket.dtype}) was not announced as such"
                f" (announced: {want}); the update is incomplete"
            )
    return bucket


def checked_tensors(
    buckets: Iterable[FlatBucket], announced_specs: Optional[dict]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor of every bucket, each bucket checked against the announced specs."""
    for bucket in buckets:
        yield from check_bucket(bucket, announced_specs).tensors()


def pending_tensors(
    buckets: Iterable[FlatBucket], announced_specs: Optional[dict]
) -> Iterator[tuple[str, torch.Tensor, Optional[PendingCheck]]]:
    """(name, view, its pending check or None) of every tensor of every bucket (each checked against the
    announced specs), for a consumer that checks each tensor as it copies it (`PendingCheck.copy_into`).

    The first bucket is checked whole before any of its tensors is handed on: nothing has reached the model
    yet, and a mismatch leaves it as it was. A later bucket's tensors come with their checks pending: the
    update has changed the model already, so finding a mismatch as the tensor is copied fails the update
    the same way, and saves a read of every byte."""
    for index, bucket in enumerate(buckets):
        bucket = check_bucket(bucket, announced_specs)
        if index == 0 or bucket.expected is None:
            yield from ((name, tensor, None) for name, tensor in bucket.tensors())
        else:
            yield from bucket.pending()


def checksums(bucket: FlatBucket) -> torch.Tensor:
    """Per tensor of the bucket, the wrapping int64 sum of the 8-byte words holding its bytes (a word shared
    with a neighbour counts for both): one read of the buffer at memory speed, on its device (on CPU about
    half the time of a copy of the same bytes, which reads and writes them: 16 against 32 ms for 0.4 GB on
    one thread). Transports that move the bytes (IPC, broadcast) send these beside each bucket.

    On CPU a sum per tensor; on a GPU the same sums in one launch (`_gpu_sums`): a kernel per tensor leaves
    them launch-bound there (hundreds of tensors per bucket; `benchmarks/ipc_device.py` on an H200, 3 GB of
    bf16 in 1 GB buckets: 0.33x of a copy's speed a tensor at a time, 0.74x from block sums, 1.65x in one
    Triton launch per bucket)."""
    raw = bucket.buffer.view(torch.uint8)
    if raw.storage_offset() % 8:  # int64 words must be aligned
        raw = raw.clone()
    size, whole = bucket.buffer.element_size(), raw.numel() // 8 * 8
    words, tail = raw[:whole].view(torch.int64), raw[whole:].to(torch.int64)  # tail: at most 7 bytes
    spans = [(entry.offset * size, (entry.offset + entry.numel) * size) for entry in bucket.entries]
    if not spans:
        return torch.zeros(0, dtype=torch.int64, device=raw.device)
    sums = _gpu_sums(words, spans) if raw.is_cuda else _looped_sums(words, spans)
    for i, (start, end) in enumerate(spans):
        if end > whole:
            sums[i] += tail[max(start - whole, 0) : end - whole].sum()
    return sums


def _gpu_sums(words: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Per byte span, the sum of the words it touches, on a GPU: one Triton launch (`devicesum`), or block
    sums (`_blocked_sums`) without Triton or where its kernel failed once."""
    if devicesum.available(words.device):
        try:
            return devicesum.span_sums(words, spans)
        except Exception as err:  # noqa: BLE001 - Triton failing to build or run the kernel on this GPU
            devicesum.disable(err)
    return _blocked_sums(words, spans)


def _looped_sums(words: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Per byte span, the sum of the words it touches: a reduction per span."""
    return torch.stack([words[start // 8 : -(-end // 8)].sum() for start, end in spans])


def _blocked_sums(words: torch.Tensor, spans: list[tuple[int, int]], block: int = 1 << 12) -> torch.Tensor:
    """`_looped_sums` in a fixed number of kernels whatever the number of spans, none waiting on the device:
    one sum per block of `block` words (one read of the buffer), their exclusive prefix sums, and prefix
    sums inside the blocks where spans begin or end; a span's sum is the difference of the prefix sums at
    its ends (integer sums wrap, so it equals the direct sum)."""
    n = words.numel()
    blocks = n // block
    full = words[: blocks * block].view(blocks, block)
    rest = words.new_zeros(1, block)  # the last, partial block, zero-padded
    rest[0, : n - blocks * block] = words[blocks * block :]
    sums = torch.cat([full.sum(1), rest.sum(1)])
    before = torch.cumsum(sums, 0) - sums  # the words before each block
    # each span's first word and the word past its last one: their block, its row below, the place in it
    ends = [index for start, end in spans for index in (start // 8, min(-(-end // 8), n))]
    touched = sorted({index // block for index in ends} - {blocks})
    row = {b: i for i, b in enumerate(touched)}
    places = [(index // block, row.get(index // block, len(touched)), index % block) for index in ends]
    places, touched = (torch.tensor(t, dtype=torch.int64).to(words.device) for t in (places, touched))
    rows = torch.cat([full.index_select(0, touched), rest])  # `rest` is the row of block `blocks`
    inside = torch.cumsum(rows, 1) - rows  # the words before each word, within its block
    prefix = (before[places[:, 0]] + inside[places[:, 1], places[:, 2]]).view(-1, 2)
    return prefix[:, 1] - prefix[:, 0]


def check_in_place(bucket: FlatBucket, indices: list[int]) -> None:
    """The checks `PendingCheck.check_in_place` left for later: the tensors of `bucket` at `indices` (in buffer
    order), summed in one `checksums` call; a mismatch raises `PendingCheck.check`'s error for the first."""
    if not indices:
        return
    if indices == list(range(len(bucket.entries))):
        _compare(bucket, checksums(bucket))
    else:
        _compare(bucket, checksums(FlatBucket(bucket.buffer, tuple(bucket.entries[i] for i in indices))), indices)


def _compare(bucket: FlatBucket, got: torch.Tensor, indices: Optional[list[int]] = None) -> None:
    """`got`, the sums of the bucket's tensors (those at `indices`), against the sender's; a mismatch raises
    `PendingCheck.check`'s error (found in the model) for the first tensor that differs, with how many more do."""
    expected = bucket.expected if indices is None else bucket.expected[indices]
    if not torch.equal(got, expected):
        first, *rest = (got != expected).nonzero().flatten().tolist()
        check = PendingCheck(bucket, first if indices is None else indices[first])
        check.check(int(got[first]), loaded=True, more=len(rest))


def corruption_first(bucket: Optional[FlatBucket], err: BaseException) -> None:
    """Where a consumer failed on a bucket whose checksums are compared only after it was handed every view
    (`FlatBucket.tensors_checked_after`: vLLM's loaders in a GPU worker, `ipc.loader_tensors`): if the bucket's
    bytes differ from what the trainer sent, that is what failed (a loader may refuse corrupted values, e.g. a
    quantization scale), so the checksum error is raised, the consumer's as its cause. Elsewhere (checked first,
    the error was the check's own, or the check cannot run) nothing changes."""
    if (
        bucket is None
        or bucket.expected is None
        or not isinstance(err, Exception)
        or isinstance(err, WeightUpdateError)
    ):
        return
    try:
        _compare(bucket, checksums(bucket))  # a mismatch: `PendingCheck.check`'s error, found in the model
    except WeightUpdateError as corrupted:
        raise corrupted from err
    except Exception:  # noqa: BLE001 - the check could not run (e.g. the GPU in an error state): the loader's error stands
        return


def verify_bucket(bucket: FlatBucket, expected: torch.Tensor) -> FlatBucket:
    """The bucket, to be checked against the sender's per-tensor checksums (`checksums`) when its tensors
    are taken (`FlatBucket.tensors`), or passed on with them by a transport that moves its buffer on
    (`ipc.IpcSender`: an engine server's vLLM workers check what the trainer summed, end to end)."""
    return replace(bucket, expected=expected.to(bucket.buffer.device))


def _check(bucket: FlatBucket, expected: torch.Tensor) -> None:
    differ = (checksums(bucket) != expected).nonzero().flatten().tolist()
    if differ:
        more = f" (and {len(differ) - 1} more tensor(s) of its bucket)" if len(differ) > 1 else ""
        raise WeightUpdateError(
            f"weight bucket corrupted on the way: the bytes of tensor {bucket.entries[differ[0]].name!r}{more}"
            " differ from what the trainer sent (checksum mismatch); nothing of the bucket was loaded"
        )


def alloc_flat(numel: int, dtype: torch.dtype, device, *, shared: bool = False) -> torch.Tensor:
    """A fresh flat buffer; `shared` on CPU: in shared memory (another process maps it, no copy)."""
    device = torch.device(device)
    if not shared or device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # file-descriptor shared memory whatever the process's sharing strategy: the segment has no name
    # (nothing is left in /dev/shm when a process is killed), another process gets it through its fd
    # (`reduce_tensor` for vLLM workers, /proc/<pid>/fd for the replica's other ranks: `shm.ShmPeers`)
    storage = torch.UntypedStorage._new_using_fd_cpu(nbytes)
    _reserve(storage, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(dtype)


def _reserve(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Allocate a shared segment's pages now (`fallocate` on its tmpfs file): where /dev/shm cannot hold
    them this is a clear error, not a SIGBUS at the first write into a page beyond it (a container's
    /dev/shm is 64 MiB unless it is given more; several processes may be filling it at once)."""
    if nbytes == 0:
        return
    fd, _ = storage._share_fd_cpu_()
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            return  # a filesystem without fallocate: pages come at first touch, as before
        raise MemoryError(
            f"no room in /dev/shm for a {nbytes / 2**20:.0f} MiB weight-sync buffer"
            f" ({free_bytes() / 2**20:.0f} MiB free): CPU weight syncs between processes"
            " keep about the model's bytes there; give the container more (docker run --shm-size=8g, or"
            " a larger /dev/shm), or use a smaller model"
        ) from err


def bucket_tensors(
    weights: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, shared: bool = False
) -> Iterator[FlatBucket]:
    """Flat buckets (≤ bucket_bytes each, or one tensor; one dtype each) of HF tensors, in order.

    Each tensor is copied once into a fresh buffer, made lazily bucket by bucket; the engine may
    keep every bucket it was given.
    """
    group: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if group and (
            tensor.dtype != group[0][1].dtype or tensor.device != group[0][1].device or used + nbytes > bucket_bytes
        ):
            yield _flatten(group, shared)
            group, used = [], 0
        group.append((name, tensor))
        used += nbytes
    if group:
        yield _flatten(group, shared)


def _flatten(group: list[tuple[str, torch.Tensor]], shared: bool) -> FlatBucket:
    first = group[0][1]
    buffer = alloc_flat(sum(t.numel() for _, t in group), first.dtype, first.device, shared=shared)
    entries, offset = [], 0
    for name, tensor in group:
        buffer[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        entries.append(HFSlot(name, tuple(tensor.shape), offset))
        offset += tensor.numel()
    return FlatBucket(buffer, tuple(entries))
