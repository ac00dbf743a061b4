"""Moving a planned bucket's bytes: pack shards, send them straight to the rollout ranks, unpack.

Owns: `stream_buckets`, the in-process transport run on every rank of one model replica (packing and
unpacking a bucket, pure: `pack`), and the buffers it moves bytes in (`BufferRing`, `SyncBuffers`,
`KeptBuffers`). Per bucket,
every TP rank of the owning stage packs its shards into ONE flat buffer and sends it, point to
point, to each rollout rank (a replicated bucket is sent by the stage's first TP rank only, packed
in HF layout); a rollout rank receives the TP buffers straight into the rows of its gathered
buffer — the TP gather of the whole bucket is one message per TP rank, never one per tensor, and
no byte takes a second hop through a stage leader. Each rank posts its sends and receives of a bucket
as one batch (`batch_isend_irecv`), `prefetch` buckets ahead of the one it unpacks (at most two
buckets' sends in flight per sender), so pipeline stages pack and ship their buckets concurrently
while a rollout rank unpacks. gloo on CPU, NCCL on GPU. The batch matters on NCCL: where two rollout
ranks are TP peers of one stage (an actor at TP2 with two TP1 engines), each sends its shards to the
other and receives the other's; NCCL runs a rank's send and receive to one peer in order on one stream
and a large send waits for the peer's receive, so posted one by one (send, then receive) both ranks
would wait on each other's send forever. gloo buffers sends, so the CPU tests cannot see the hang.
Where every rank of the replica is a CPU process on one host (`peers`, `shm.ShmPeers`), no row is
sent at all: the rollout rank sends each source its row's place in a shared-memory gathered buffer
and the source packs into it, then answers "written". Where every parameter of a sharded bucket
can place one rank's shard (`Bucket.shards_write_flat`: the QKV, gate/up, vocab and plain split
rules all can), the place is the buffer's start and each TP rank, the rollout rank included,
writes its shards straight into the flat bucket in HF layout (`write_shards`): the buffer is the
flat bucket when the last "written" arrives and the rollout rank unpacks nothing. Into a bucket that
lands flat that way, every writer copies under `writesums.WriteSums` and its "written" carries the
per-tensor word sums of what it wrote: added up, they are the bucket's checksums (`protocol.checksums`),
which the rollout rank yields with it, so a verifying sender does not read the bucket again. On a GPU a
rollout rank that packs a whole bucket itself (its stage's only source: TP 1, or a replicated bucket) sums it
in the same launch (`pack.pack_bucket_summed`), to the same end.

Unpacking writes every HF tensor once, with the mapping's own rule (`Mapping.unshard_to_hf`: QKV
split per query group and gate/up per shard in the same pass, vocab padding never copied), into
one output buffer; a replicated bucket's received buffer is already the flat bucket (no copy), and
so is a sharded bucket of one embedding or output layer, whose HF tensor is its shards in order
(`Bucket.arrives_flat`). A rollout rank that is itself a TP rank of the bucket's stage does not pack
its own shards of a bucket that needs unpacking: unpacking reads them from its parameters (one copy
of its share, not two).
Buffers are reused from bucket to bucket within a sync (fresh allocations cost page faults
comparable to the copy itself) unless the consumer keeps them (`fresh=True`: every yielded
bucket gets its own buffer); after a sync they are freed, except on CPU, where the sharding
manager keeps the rings for the next sync (`SyncBuffers`: a freed large buffer comes back as
fresh pages) and, for a consumer in another process, one shared-memory buffer per bucket
(`KeptBuffers`, written again by every sync). Peak extra memory on a rollout rank:
(1 + prefetch) gathered buckets + one output bucket (3 × bucket_bytes by default) plus, with
`fresh`, the buckets the consumer still holds; on a sender: two packed shares of a bucket.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from typing import Iterator, NamedTuple, Optional, Sequence

import torch

from megarl.rollout.sharding import writesums
from megarl.rollout.sharding.pack import device_of, pack_bucket, pack_bucket_summed, write_shards
from megarl.rollout.sharding.plan import Bucket
from megarl.rollout.sharding.protocol import alloc_flat
from megarl.rollout.sharding.shm import ShmPeers
from megarl.rollout.sharding.writesums import WriteSums


def lands_flat(bucket: Bucket, peers: Optional[ShmPeers]) -> bool:
    """Whether the gathered buffer starts with the flat bucket once received: it `arrives_flat`,
    or its TP ranks write it in HF layout over shared memory (`Bucket.shards_write_flat`)."""
    return bucket.arrives_flat or (peers is not None and bucket.shards_write_flat)


def stream_buckets(
    buckets: Sequence[Bucket],
    local_params: dict,
    *,
    my_rank: int,
    stage_ranks: dict[tuple[int, int], Sequence[int]],
    dest_ranks: Sequence[int],
    my_source: Optional[tuple[int, int]],
    dims,
    prefetch: int = 1,
    fresh: bool = False,
    shared: bool = False,
    kept: Optional["KeptBuffers"] = None,
    buffers: Optional["SyncBuffers"] = None,
    group=None,
    peers: Optional[ShmPeers] = None,
) -> Iterator[tuple[Bucket, torch.Tensor, Optional[int], Optional[torch.Tensor]]]:
    """Run this rank's part of moving every bucket; yields (bucket, gathered buffer, own row, sums) on rollout ranks.

    own row: in a bucket of this rank's own stage that needs unpacking (not `lands_flat`), the row of the
    gathered buffer left unwritten (`unpack_bucket(..., own=(row, local_params))` reads those shards
    from the parameters); None otherwise. sums: the flat bucket's `protocol.checksums` as its writers took
    them (`_added`), or None.

    `stage_ranks[(pp, ep)][tp]` are global ranks (ep is 0 without expert parallelism), `my_source`
    this rank's (pp, ep) (None: not a training rank). `group`: the replica's process group, holding every
    source and destination (a group with a collective behind it: NCCL creates a batch's communicator then).
    Every rank of the replica must exhaust the generator. A yielded buffer stays valid until the
    generator is resumed; with `fresh`, the buffer of a bucket that `lands_flat` (it becomes the flat
    bucket) is never reused within this sync (with `kept`, it is that bucket's kept buffer, which the
    next sync writes again). `shared`: yielded buffers live in shared memory (CPU). `buffers`: the
    rings to reuse (a previous sync's, `SyncBuffers`); fresh ones when None. `peers`: every rank of
    the replica is a CPU process on this host: senders write their rows straight into the rollout
    ranks' shared-memory gathered buffers (`shm.ShmPeers`) instead of sending them.
    """
    buffers = buffers or SyncBuffers(prefetch, shared=shared or peers is not None)
    sends: deque = deque()  # (works, packed buffer) of this rank's last buckets sent
    posted: deque = deque()  # this rank's receives, in the plan's order
    receiving = my_rank in dest_ranks
    for bucket in buckets:  # the plan's transfer order: every rank posts in it, so p2p messages match
        gathered, recv_ops, own_row, write_own, written = None, [], None, _nothing, []
        if receiving:
            gathered, recv_ops, own_row, write_own, written = _receive_ops(
                bucket,
                local_params,
                dims,
                my_rank,
                stage_ranks,
                buffers.recv,
                fresh and lands_flat(bucket, peers),
                kept,
                group,
                peers,
            )
        if peers is not None:  # places first: a rank that is also a sender then waits for its receivers'
            recv_works = _post(recv_ops)
            written += _listed(write_own())  # while the other TP ranks write theirs
            if bucket.source == my_source:
                sends.append(_write_rows(bucket, local_params, dims, my_rank, stage_ranks, dest_ranks, peers, group))
        else:
            send_ops = []
            if bucket.source == my_source:
                send_ops = _send_ops(
                    bucket, local_params, dims, my_rank, stage_ranks, dest_ranks, sends, buffers.send, group
                )
            works = _post(send_ops + recv_ops)
            written += _listed(write_own())  # the sums of what it wrote, where it took them (`_pack_own`)
            if send_ops:
                sends.append((works[: len(send_ops)], send_ops[0].tensor))
            recv_works = works[len(send_ops) :]
        if receiving:
            posted.append((bucket, gathered, recv_works, own_row, written if lands_flat(bucket, peers) else None))
            if len(posted) > prefetch:
                yield _finish_receive(*posted.popleft())
    while posted:
        yield _finish_receive(*posted.popleft())
    for works, _ in sends:
        for work in works:
            work.wait()


class BufferRing:
    """A ring of reusable byte buffers (grown to the largest request); slot i is reused every n requests.

    shared: buffers in shared memory (on CPU), for consumers in another process.
    """

    def __init__(self, n: int, *, shared: bool = False):
        self.buffers: list[Optional[torch.Tensor]] = [None] * n
        self.next = 0
        self.shared = shared

    def take(self, numel: int, dtype: torch.dtype, device, *, fresh: bool = False) -> torch.Tensor:
        """A flat [numel] buffer of `dtype`; `fresh`: a new one the ring never hands out again."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if fresh:
            return alloc_flat(nbytes, torch.uint8, device, shared=self.shared).view(dtype)
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            buf = self.buffers[i] = alloc_flat(nbytes, torch.uint8, device, shared=self.shared)
        return buf[:nbytes].view(dtype)


class SyncBuffers:
    """The rings one sync reuses from bucket to bucket: gathered buckets, packed shares, unpacked outputs.

    On CPU the sharding manager keeps them from sync to sync: a large buffer freed to the system
    comes back as fresh pages, and faulting them in costs several times the copy into them (about
    6× on a 2-core host). Held between syncs: the rings' buffers, at most (1 + prefetch) gathered
    buckets + one output bucket on a rollout rank and two packed shares on a sender. On GPU the
    caching allocator already reuses freed blocks, so nothing is kept there (`keepable`).
    """

    def __init__(self, prefetch: int, *, shared: bool = False):
        self.recv = BufferRing(prefetch + 1, shared=shared)
        self.send = BufferRing(2)
        self.out = BufferRing(1, shared=shared)

    def keepable(self) -> bool:
        """True when every buffer the rings hold is in host memory."""
        rings = (self.recv, self.send, self.out)
        return all(b is None or b.device.type == "cpu" for ring in rings for b in ring.buffers)


def adoption_enabled() -> bool:
    """Whether senders may offer engines their kept buffers as parameters (`MEGARL_ADOPT_WEIGHTS=0`: never; the
    engines then copy every update in)."""
    return os.environ.get("MEGARL_ADOPT_WEIGHTS", "1") != "0"


class KeptBuffers:
    """Buffers kept from sync to sync, one per key (a bucket's position and role).

    For consumers in another process that keep a bucket's buffer until the end of an update (vLLM's
    reload; shared memory): within one update every bucket still has a buffer of its own, but the
    next update writes into the same ones: no fresh shared-memory pages to allocate and zero every
    sync (the consumer maps pages that already exist). An engine that takes synced buckets as its
    parameters owns a set of its own (`EmbeddedEngine.update_buffers`; shared memory only where the
    replica's other ranks write into them): every later sync writes straight into the model. The
    price: the buffers stay allocated (about the model's HF bytes). With `device` (an engine's own
    buffers on its GPU: they become its parameters, so keeping them costs no memory) only that device's
    are kept, else only host memory; `take` hands out a fresh buffer on any other device each time (a
    GPU's caching allocator reuses freed blocks, and GPU memory kept beside the trainer's would be lost
    to it). `clear` lets them all go (the engine asleep: its holders keep none alive either).
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.buffers: dict = {}  # (key, shared) → buffer
        self.device = None if device is None else torch.device(device)

    def take(self, key, numel: int, dtype: torch.dtype, device, *, shared: bool = True) -> torch.Tensor:
        """The buffer kept for `key` ([numel] of `dtype`); `shared`: one in shared memory (kept apart from
        a private one of the same key: syncs over two transports alternate without reallocating)."""
        device = torch.device(device)
        own = self.device or torch.device("cpu")  # the one device whose buffers are kept
        if device.type != own.type or (device.type != "cpu" and device != own):
            return alloc_flat(numel, dtype, device)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self.buffers.get((key, shared))
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[(key, shared)] = alloc_flat(nbytes, torch.uint8, device, shared=shared)
        return buf[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def clear(self) -> None:
        self.buffers.clear()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in one of the kept buffers."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers.values())


def _sources(bucket: Bucket, stage_ranks) -> list[int]:
    stage = stage_ranks[bucket.source]
    return list(stage) if bucket.sharded else [stage[0]]


def _send_ops(bucket, local_params, dims, my_rank, stage_ranks, dest_ranks, sends: deque, slots: BufferRing, group):
    """Pack this rank's shards; the sends of them to every other rollout rank (at most 2 buckets in flight)."""
    import torch.distributed as dist

    if my_rank not in _sources(bucket, stage_ranks):
        return []
    targets = [d for d in dest_ranks if d != my_rank]
    if not targets:
        return []
    while len(sends) >= 2:  # the oldest buffer is about to be reused
        for work in sends.popleft()[0]:
            work.wait()
    buf = pack_bucket(
        bucket, local_params, dims, slots.take(bucket.local_numel, bucket.dtype, device_of(bucket, local_params))
    )
    return [dist.P2POp(dist.isend, buf, d, group, tag=bucket.index) for d in targets]


def _receive_ops(
    bucket,
    local_params,
    dims,
    my_rank,
    stage_ranks,
    slots: BufferRing,
    fresh: bool,
    kept: Optional[KeptBuffers],
    group,
    peers: Optional[ShmPeers] = None,
):
    """(gathered buffer [rows, local_numel], receives of every remote row, own row, the write of this
    rank's own share to run once the receives are posted, the "written" messages to receive); our own row is
    written only when the buffer is the flat bucket (`lands_flat`), else it stays unwritten (the own row, for
    `unpack_bucket`). With `peers`, a remote row's "receive" is sending its sender the row's place and
    receiving "written" (with the sums of what it wrote, `_summed`); where the shards write flat, the place is
    the buffer's start and every rank writes in HF layout. With `peers`, the own write returns its "written"
    message too; without, a `PackSums` where it took the sums of a whole bucket (`_pack_own`), else None."""
    import torch.distributed as dist

    sources = _sources(bucket, stage_ranks)
    device = device_of(bucket, local_params) if my_rank in sources else _default_device()
    numel = len(sources) * bucket.local_numel
    flat = (
        kept.take(("gathered", bucket.index), numel, bucket.dtype, device, shared=slots.shared)
        if fresh and kept is not None
        else slots.take(numel, bucket.dtype, device, fresh=fresh)
    )
    gathered = flat.view(len(sources), -1)
    direct = peers is not None and bucket.shards_write_flat
    ops, own_row, write_own, written = [], None, _nothing, []
    for row, src in enumerate(sources):
        if src != my_rank:
            if peers is None:
                ops.append(dist.P2POp(dist.irecv, gathered[row], src, group, tag=bucket.index))
            else:
                place = peers.place(flat if direct else gathered[row])
                written.append(_no_sums(bucket))  # the receive buffer of its "written"
                ops.append(dist.P2POp(dist.isend, place, src, group, tag=2 * bucket.index))
                ops.append(dist.P2POp(dist.irecv, written[-1], src, group, tag=2 * bucket.index + 1))
        elif direct:
            write = functools.partial(write_shards, bucket, local_params, dims, row, flat)
            write_own = functools.partial(_summed, bucket, flat, 0, write)
        elif not bucket.arrives_flat:
            own_row = row
        elif peers is not None:
            write = functools.partial(pack_bucket, bucket, local_params, dims, out=gathered[row])
            write_own = functools.partial(_summed, bucket, gathered[row], row * bucket.local_numel, write)
        else:
            write_own = functools.partial(_pack_own, bucket, local_params, dims, gathered[row], len(sources) == 1)
    return gathered, ops, own_row, write_own, written


class PackSums(NamedTuple):
    """The "written" message of a rollout rank's own pack of a whole bucket that summed what it wrote (a GPU's
    one launch, `_pack_own`): complete by construction, its sums left where they are (on the GPU: reading a
    flag back would wait for it)."""

    sums: torch.Tensor


def _pack_own(bucket: Bucket, local_params: dict, dims, out: torch.Tensor, whole: bool) -> Optional[PackSums]:
    """Pack this rank's row of a bucket that lands flat; where the row is the `whole` bucket and the pack summed
    what it wrote (`pack_bucket_summed`), its "written" message with those sums."""
    _, sums = pack_bucket_summed(bucket, local_params, dims, out=out)
    return PackSums(sums) if whole and sums is not None else None


def _write_rows(bucket, local_params, dims, my_rank, stage_ranks, dest_ranks, peers: ShmPeers, group) -> tuple:
    """Same host: pack this rank's shards straight into each other rollout rank's gathered buffer, at
    the place it sent (in HF layout, into the flat bucket, where `Bucket.shards_write_flat`); the
    "written" sends (their works) and their messages (the sums of what it wrote, where the bucket lands
    flat: `_summed`)."""
    import torch.distributed as dist

    sources = _sources(bucket, stage_ranks)
    if my_rank not in sources:
        return [], []
    works, messages, row = [], [], sources.index(my_rank)
    for dest in dest_ranks:
        if dest == my_rank:
            continue
        place = peers.message()
        dist.irecv(place, dest, group, tag=2 * bucket.index).wait()
        if bucket.shards_write_flat:
            out = peers.open(place, bucket.hf_numel, bucket.dtype)
            message = _summed(bucket, out, 0, functools.partial(write_shards, bucket, local_params, dims, row, out))
        else:
            out = peers.open(place, bucket.local_numel, bucket.dtype)
            write = functools.partial(pack_bucket, bucket, local_params, dims, out=out)
            if bucket.arrives_flat:
                message = _summed(bucket, out, row * bucket.local_numel, write)
            else:  # no sums: the rollout rank unpacks it
                write()
                message = _no_sums(bucket)
        messages.append(message)
        works.append(dist.isend(message, dest, group, tag=2 * bucket.index + 1))
    return works, messages


def _summed(bucket: Bucket, out: torch.Tensor, offset: int, write) -> torch.Tensor:
    """Run `write` (this rank's share of a bucket that lands flat, written into `out`, which lies `offset`
    elements into the flat bucket) under `WriteSums`; its "written" message: [complete, per-tensor sums]."""
    if not writesums.enabled() or bucket.nbytes < writesums.MIN_BUCKET_BYTES:
        write()
        return _no_sums(bucket)
    with WriteSums(
        out.data_ptr() - offset * out.element_size(),
        out.untyped_storage().data_ptr(),
        bucket.entries,
        out.element_size(),
    ) as sums:
        write()
    return sums.result()


def _no_sums(bucket: Bucket) -> torch.Tensor:
    """A "written" message without sums (its first element, complete, is 0)."""
    return torch.zeros(1 + len(bucket.entries), dtype=torch.int64)


def _added(bucket: Bucket, written: Optional[list]) -> Optional[torch.Tensor]:
    """The flat bucket's checksums from its writers' "written" messages; None where there are none, where a
    writer could not sum all it wrote, or where a tensor begins or ends inside a word (its checksum then counts
    a neighbour's bytes of that word, which its writers did not sum for it). A `PackSums` is the only writer's."""
    size = torch.empty((), dtype=bucket.dtype).element_size()
    if not written or any(not isinstance(m, PackSums) and int(m[0]) != 1 for m in written):
        return None
    if any((e.offset * size) % 8 or ((e.offset + e.numel) * size) % 8 for e in bucket.entries):
        return None
    if isinstance(written[0], PackSums):
        assert len(written) == 1, "a rollout rank's own summed pack is the bucket's only writer"
        return written[0].sums
    return torch.stack(written).sum(0)[1:]


def _listed(message) -> list:
    """The own write's "written" message as a list to add to the others' (empty where it sent none)."""
    return [] if message is None else [message]


def _nothing() -> None:
    """No share of this rank to write."""


def _post(ops: list) -> list:
    """Post a bucket's sends and receives of this rank as one batch; their works, in the same order."""
    import torch.distributed as dist

    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    return works if len(works) == len(ops) else works * len(ops)  # NCCL: one work for the coalesced batch


def _finish_receive(bucket, gathered, works, own_row, written):
    for work in works:
        work.wait()
    return bucket, gathered.view(-1), own_row, _added(bucket, written)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
