"""Packing a planned bucket: a TP rank's parameters → one flat buffer, and the gathered rows → the flat bucket of
HF tensors. Pure torch on tensors, no process groups (`transport` moves the bytes between ranks).

Owns: `pack_bucket` (a rank's shards, or a replicated bucket's HF tensors, in one flat buffer; on a GPU in few
launches), `write_shards` (one TP rank's shards straight into the flat bucket, HF layout) and `unpack_bucket`
(the TP rows → the flat bucket, each HF tensor written once by its mapping's rule, `Mapping.unshard_to_hf`).
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.rollout.sharding.plan import Bucket
from megarl.rollout.sharding.protocol import FlatBucket


def pack_bucket(
    bucket: Bucket,
    local_params: dict,
    dims,
    out: Optional[torch.Tensor] = None,
    batched: Optional[bool] = None,
) -> torch.Tensor:
    """This TP rank's part of the bucket, in one flat buffer [local_numel]: its shards (sharded
    buckets) or the HF tensors of its parameters (replicated buckets).

    `local_params` maps (vp_stage, chunk-local name) → the parameter tensor. `batched` (default: on a
    GPU) makes the copies in few launches (`_pack_batched`); else one `copy_` per HF tensor, which is what
    `writesums.WriteSums` sums as it goes (CPU).
    """
    buf = (
        out
        if out is not None
        else torch.empty(bucket.local_numel, dtype=bucket.dtype, device=device_of(bucket, local_params))
    )
    if buf.is_cuda if batched is None else batched:
        _pack_batched(bucket, local_params, dims, buf)
        return buf
    for p in bucket.params:
        _pack_param(bucket, p, local_params[(p.meta.vp_stage, p.meta.name)].detach(), dims, buf)
    return buf


def _pack_param(bucket: Bucket, p, src: torch.Tensor, dims, buf: torch.Tensor) -> None:
    if bucket.sharded:
        buf[p.offset : p.offset + p.numel].view(p.meta.shape).copy_(src)
    else:
        p.mapping.unshard_to_hf([src], dims, buf[p.offset : p.offset + p.hf_numel])


def _pack_batched(bucket: Bucket, local_params: dict, dims, buf: torch.Tensor) -> None:
    """`pack_bucket` in few launches. On a GPU each copy is a kernel launch whose CPU cost (Python, dispatch:
    ~50 µs an HF tensor on an H200 under gVisor) far exceeds its GPU time: `benchmarks/sync_device.py`'s sync
    of 255 tensors took 10.5 ms copied one by one, 6.1 ms batched. Whole runs of rows (a TP shard; HF tensors
    that are the first rows of their TP1 tensor, `Mapping.tp1_hf_rows`) go in one `torch._foreach_copy_`, rows
    in another order (QKV) in one `index_select` each, anything else by its mapping's rule."""
    dsts, srcs = [], []
    for p in bucket.params:
        src = local_params[(p.meta.vp_stage, p.meta.name)].detach()
        rows = None  # a parameter of another shape than planned takes the per-tensor path, which says so
        if src.dim() > 0 and src.is_contiguous() and tuple(src.shape) == tuple(p.meta.shape):
            rows = range(src.shape[0]) if bucket.sharded else p.mapping.tp1_hf_rows(dims, src.shape[0], src.device)
        if rows is None:
            _pack_param(bucket, p, src, dims, buf)
            continue
        out = buf[p.offset : p.offset + (p.numel if bucket.sharded else p.hf_numel)]  # `_pack_param`'s place
        if isinstance(rows, range):
            dsts.append(out)
            srcs.append(src.view(-1)[: out.numel()])
        else:
            torch.index_select(src, 0, rows, out=out.view(len(rows), *src.shape[1:]))
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def write_shards(bucket: Bucket, local_params: dict, dims, tp_rank: int, out: torch.Tensor) -> None:
    """This TP rank's shards of a sharded bucket written straight into the flat bucket `out` (HF
    layout; `Bucket.shards_write_flat`): the TP ranks' writes together are `unpack_bucket`'s result."""
    cursor = 0
    for p in bucket.params:
        src = local_params[(p.meta.vp_stage, p.meta.name)].detach()
        p.mapping.shard_to_hf(src, tp_rank, bucket.tp_size, dims, out[cursor : cursor + p.hf_numel])
        cursor += p.hf_numel


def unpack_bucket(
    bucket: Bucket,
    gathered: torch.Tensor,
    dims,
    out: Optional[torch.Tensor] = None,
    own: Optional[tuple[int, dict]] = None,
) -> FlatBucket:
    """The flat bucket of HF tensors from the gathered buffer [rows * local_numel] (rows: TP size, or 1).

    Sharded buckets are written into `out` (a flat buffer of ≥ `bucket.hf_numel` elements,
    allocated when None); a bucket that `arrives_flat` (replicated, or one parameter whose shards
    in order are its HF tensor) is the start of the gathered buffer itself. `own` = (row,
    local_params): that row of a sharded bucket was never packed (a rollout rank that is itself a
    TP rank of the bucket's stage); its shards are read from the parameters themselves, which
    saves copying this rank's share twice.
    """
    if bucket.arrives_flat:
        return FlatBucket(gathered[: bucket.hf_numel], bucket.entries)
    rows = gathered.view(bucket.tp_size, bucket.local_numel)
    if out is None:
        out = torch.empty(bucket.hf_numel, dtype=gathered.dtype, device=gathered.device)
    cursor = 0
    for p in bucket.params:
        shards = [row[p.offset : p.offset + p.numel].view(p.meta.shape) for row in rows]
        if own is not None:
            shards[own[0]] = own[1][(p.meta.vp_stage, p.meta.name)].detach()
        p.mapping.unshard_to_hf(shards, dims, out[cursor : cursor + p.hf_numel])
        cursor += p.hf_numel
    return FlatBucket(out[: bucket.hf_numel], bucket.entries)


def device_of(bucket: Bucket, local_params: dict) -> torch.device:
    """Where this rank's parameters of the bucket are."""
    first = bucket.params[0].meta
    return local_params[(first.vp_stage, first.name)].device
