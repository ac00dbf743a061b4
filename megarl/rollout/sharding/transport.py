"""Moving a planned bucket's bytes: pack shards, send them straight to the rollout ranks, unpack.

Owns: `pack_bucket` / `unpack_bucket` (pure: flat buffer ↔ HF tensors by the plan) and
`stream_buckets`, the in-process transport run on every rank of one model replica. Per bucket,
every TP rank of the owning stage packs its shards into ONE flat buffer and sends it, point to
point, to each rollout rank (a replicated bucket is sent by the stage's first TP rank only); a
rollout rank receives the TP buffers straight into the rows of its gathered buffer — the TP
gather of the whole bucket is one message per TP rank, never one per tensor, and no byte takes
a second hop through a stage leader. Sends are non-blocking (`isend`, at most two buckets in
flight per sender) and the rollout rank posts its receives `prefetch` buckets ahead, so pipeline
stages pack and ship their buckets concurrently while it unpacks. gloo on CPU, NCCL on GPU.

Unpacking writes every HF tensor once: shards are concatenated straight into the output
(QKV split per query group and gate/up per shard in the same pass, vocab padding never copied);
replicated tensors are views of the received buffer. Buffers are reused from bucket to bucket
within a sync (fresh allocations cost page faults comparable to the copy itself) and freed after
it. Peak extra memory on a rollout rank: (1 + prefetch) gathered buckets + one output bucket
(3 × bucket_bytes by default); on a sender: two packed shares of a bucket.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, Optional, Sequence

import torch

from megarl.models.mapping import GateUpMapping, Mapping, QKVMapping, VocabMapping
from megarl.rollout.sharding.plan import Bucket


def pack_bucket(bucket: Bucket, local_params: dict, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This TP rank's shards of the bucket, flattened into one buffer [local_numel].

    `local_params` maps (vp_stage, chunk-local name) → the parameter tensor.
    """
    buf = out if out is not None else torch.empty(bucket.local_numel, dtype=bucket.dtype,
                                                  device=_device_of(bucket, local_params))
    for p in bucket.params:
        src = local_params[(p.meta.vp_stage, p.meta.name)].detach()
        buf[p.offset:p.offset + p.numel].view(p.meta.shape).copy_(src)
    return buf


def unpack_bucket(bucket: Bucket, gathered: torch.Tensor, dims, out: Optional[torch.Tensor] = None
                  ) -> list[tuple[str, torch.Tensor]]:
    """HF tensors from the gathered buffer [rows * local_numel] (rows: TP size, or 1 if replicated).

    Sharded tensors are written into `out` (a flat buffer of ≥ `bucket.gathered_numel` elements,
    allocated when None); replicated ones are views of `gathered`.
    """
    rows = gathered.view(bucket.tp_size if bucket.sharded else 1, bucket.local_numel)
    if out is None and bucket.sharded:
        out = torch.empty(bucket.gathered_numel, dtype=gathered.dtype, device=gathered.device)
    result, cursor = [], 0
    for p in bucket.params:
        shards = [row[p.offset:p.offset + p.numel].view(p.meta.shape) for row in rows]
        if len(shards) == 1:
            result.extend(zip(p.mapping.hf, p.mapping.to_hf(shards[0], dims)))
            continue
        tensors = _shards_to_hf(p, shards, dims, out[cursor:cursor + p.numel * len(shards)])
        cursor += p.numel * len(shards)
        result.extend(zip(p.mapping.hf, tensors))
    return result


def _shards_to_hf(p, shards: list[torch.Tensor], dims, space: torch.Tensor) -> list[torch.Tensor]:
    """`mapping.to_hf(mapping.unshard(shards))` in one copy, into `space` (same numel as the shards)."""
    mapping = p.mapping
    if isinstance(mapping, QKVMapping):
        return _qkv_to_hf(shards, dims, space)
    if isinstance(mapping, GateUpMapping):  # every shard is [gate_r; up_r] → [gate; up]
        halves = [s.chunk(2, dim=0) for s in shards]
        full = space.view(sum(s.shape[0] for s in shards), *shards[0].shape[1:])
        torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0, out=full)
        return list(full.chunk(2, dim=0))
    if type(mapping) in (Mapping, VocabMapping):  # concatenation on tp_dim; to_hf drops vocab rows as a view
        shape = list(shards[0].shape)
        shape[mapping.tp_dim] *= len(shards)
        full = space.view(shape)
        torch.cat(shards, dim=mapping.tp_dim, out=full)
        return mapping.to_hf(full, dims)
    return mapping.to_hf(mapping.unshard(shards), dims)  # an unknown mapping kind: its own rules


def _qkv_to_hf(shards, dims, space) -> list[torch.Tensor]:
    """q, k, v from per-rank QKV shards (whole query groups each), written once into `space`."""
    groups, head_dim = dims.num_kv_heads, dims.head_dim
    q_rows = dims.num_heads // groups * head_dim
    rest = tuple(shards[0].shape[1:])
    inner = torch.Size(rest).numel()
    q_n, kv_n = groups * q_rows * inner, groups * head_dim * inner
    q = space[:q_n].view(groups, q_rows, *rest)
    k = space[q_n:q_n + kv_n].view(groups, head_dim, *rest)
    v = space[q_n + kv_n:q_n + 2 * kv_n].view(groups, head_dim, *rest)
    start = 0
    for shard in shards:
        local = shard.view(-1, q_rows + 2 * head_dim, *rest)
        g = local.shape[0]
        sq, sk, sv = local.split([q_rows, head_dim, head_dim], dim=1)
        q[start:start + g].copy_(sq)
        k[start:start + g].copy_(sk)
        v[start:start + g].copy_(sv)
        start += g
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def stream_buckets(buckets: Sequence[Bucket], local_params: dict, *, my_rank: int,
                   stage_ranks: dict[tuple[int, int], Sequence[int]], dest_ranks: Sequence[int],
                   my_source: Optional[tuple[int, int]], prefetch: int = 1) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Run this rank's part of moving every bucket; yields (bucket, gathered buffer) on rollout ranks.

    `stage_ranks[(pp, ep)][tp]` are global ranks (ep is 0 without expert parallelism), `my_source`
    this rank's (pp, ep) (None: not a training rank).
    Every rank of the replica must exhaust the generator. A yielded buffer stays valid until the
    generator is resumed.
    """
    order = list(buckets)  # the plan's transfer order; p2p messages match by (source, tag)
    recv_slots, send_slots = BufferRing(prefetch + 1), BufferRing(2)
    sends: deque = deque()
    posted: deque = deque()
    to_post = iter(order) if my_rank in dest_ranks else iter(())
    for bucket in order:
        if bucket.source == my_source:
            _send_bucket(bucket, local_params, my_rank, stage_ranks, dest_ranks, sends, send_slots)
        if my_rank in dest_ranks:
            while len(posted) <= prefetch and (nxt := next(to_post, None)) is not None:
                posted.append(_post_receive(nxt, local_params, my_rank, stage_ranks, recv_slots))
            yield _finish_receive(*posted.popleft())
    for works, _ in sends:
        for work in works:
            work.wait()


class BufferRing:
    """A ring of reusable byte buffers (grown to the largest request); slot i is reused every n requests."""

    def __init__(self, n: int):
        self.buffers: list[Optional[torch.Tensor]] = [None] * n
        self.next = 0

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            buf = self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)


def _sources(bucket: Bucket, stage_ranks) -> list[int]:
    stage = stage_ranks[bucket.source]
    return list(stage) if bucket.sharded else [stage[0]]


def _send_bucket(bucket, local_params, my_rank, stage_ranks, dest_ranks, sends: deque, slots: BufferRing) -> None:
    """Pack this rank's shards and isend them to every other rollout rank (at most 2 buckets in flight)."""
    import torch.distributed as dist

    if my_rank not in _sources(bucket, stage_ranks):
        return
    targets = [d for d in dest_ranks if d != my_rank]
    if not targets:
        return
    while len(sends) >= 2:  # the oldest buffer is about to be reused
        for work in sends.popleft()[0]:
            work.wait()
    buf = pack_bucket(bucket, local_params, slots.take(bucket.local_numel, bucket.dtype,
                                                         _device_of(bucket, local_params)))
    sends.append(([dist.isend(buf, dst=d, tag=bucket.index) for d in targets], buf))


def _post_receive(bucket, local_params, my_rank, stage_ranks, slots: BufferRing):
    """Take a gathered buffer [rows, local_numel]; irecv every remote row, pack our own."""
    import torch.distributed as dist

    sources = _sources(bucket, stage_ranks)
    device = _device_of(bucket, local_params) if my_rank in sources else _default_device()
    gathered = slots.take(len(sources) * bucket.local_numel, bucket.dtype, device).view(len(sources), -1)
    works = []
    for row, src in enumerate(sources):
        if src == my_rank:
            pack_bucket(bucket, local_params, out=gathered[row])
        else:
            works.append(dist.irecv(gathered[row], src=src, tag=bucket.index))
    return bucket, gathered, works


def _finish_receive(bucket, gathered, works):
    for work in works:
        work.wait()
    return bucket, gathered.view(-1)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_of(bucket: Bucket, local_params: dict) -> torch.device:
    first = bucket.params[0].meta
    return local_params[(first.vp_stage, first.name)].device
