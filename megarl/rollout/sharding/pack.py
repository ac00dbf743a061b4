"""Packing a planned bucket: a TP rank's parameters → one flat buffer, and the gathered rows → the flat bucket of
HF tensors. Pure torch on tensors, no process groups (`transport` moves the bytes between ranks).

Owns: `pack_bucket` (a rank's shards, or a replicated bucket's HF tensors, in one flat buffer; on a GPU in one
Triton launch that also takes the bucket's checksums, `pack_bucket_summed`, else in few), `write_shards` (one TP
rank's shards straight into the flat bucket, HF layout) and `unpack_bucket` (the TP rows → the flat bucket, each HF
tensor written once by its mapping's rule, `Mapping.unshard_to_hf`; on a GPU in one launch, `unpack_runs`).
"""

from __future__ import annotations

import bisect
import math
from typing import Optional

import torch

from megarl.rollout.sharding import devicesum
from megarl.rollout.sharding.plan import Bucket
from megarl.rollout.sharding.protocol import FlatBucket
from megarl.rollout.sharding.unpack_runs import unpack_in_one_launch


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
    GPU) makes the copies in few launches (`_pack_in_one_launch`, else `_pack_batched`); else one `copy_`
    per HF tensor, which is what `writesums.WriteSums` sums as it goes (CPU).
    """
    return pack_bucket_summed(bucket, local_params, dims, out, batched)[0]


def pack_bucket_summed(
    bucket: Bucket,
    local_params: dict,
    dims,
    out: Optional[torch.Tensor] = None,
    batched: Optional[bool] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`pack_bucket`, and a replicated bucket's per-tensor checksums (`protocol.checksums` of the flat bucket it
    is) where the pack took them as it wrote it (one launch on a GPU, `_pack_in_one_launch`); else None."""
    buf = (
        out
        if out is not None
        else torch.empty(bucket.local_numel, dtype=bucket.dtype, device=device_of(bucket, local_params))
    )
    if not (buf.is_cuda if batched is None else batched):
        for p in bucket.params:
            _pack_param(bucket, p, local_params[(p.meta.vp_stage, p.meta.name)].detach(), dims, buf)
        return buf, None
    sums = _pack_in_one_launch(bucket, local_params, dims, buf)
    if sums is None:
        _pack_batched(bucket, local_params, dims, buf)
    return buf, None if bucket.sharded else sums


def _pack_param(bucket: Bucket, p, src: torch.Tensor, dims, buf: torch.Tensor) -> None:
    if bucket.sharded:
        buf[p.offset : p.offset + p.numel].view(p.meta.shape).copy_(src)
    else:
        p.mapping.unshard_to_hf([src], dims, buf[p.offset : p.offset + p.hf_numel])


def _pack_in_one_launch(bucket: Bucket, local_params: dict, dims, buf: torch.Tensor) -> Optional[torch.Tensor]:
    """`pack_bucket` as one Triton launch that copies every run of words (`devicesum.copy_sums`; the runs:
    `_copy_runs`) and sums them per HF tensor as it writes them; its sums (a sharded bucket's are of no
    tensor). None, with nothing written, where it cannot: no kernel here, a run off an 8-byte word, or a
    parameter not as planned (a plain tensor of its shape, contiguous, the buffer's dtype and device). A kernel
    that fails to build or run is not tried again (`devicesum.disable`)."""
    runs = _copy_runs(bucket, dims, buf.element_size())
    if runs is None or buf.data_ptr() % 8 or not devicesum.available(buf.device, "piece_copy_sums"):
        return None
    addresses = []
    for p in bucket.params:
        src = local_params[(p.meta.vp_stage, p.meta.name)]
        if not devicesum.readable(src, p.meta.shape, buf):
            return None
        addresses.append(src.data_ptr())
    key = ("copy table", str(buf.device), dims, buf.element_size())  # the runs' own key, and the device
    kept = bucket.memo.get(key)
    if kept is None or kept[0] != addresses:  # the table names the sources by address: kept while they stay put
        segments = [
            (address + first, at, count, owner)
            for address, param_runs in zip(addresses, runs)
            for first, at, count, owner in param_runs
        ]
        kept = bucket.memo[key] = (addresses, devicesum.copy_table(segments, buf.device))
    words = buf.view(torch.uint8)[: buf.numel() * buf.element_size() // 8 * 8].view(torch.int64)
    try:
        return devicesum.copy_sums(words, kept[1], len(bucket.entries))
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - Triton failing to build or run the kernel on this GPU
        devicesum.disable(err, "piece_copy_sums")
        return None


def _copy_runs(bucket: Bucket, dims, itemsize: int) -> Optional[tuple]:
    """Per parameter, its copy into the bucket as runs (source byte offset, first bucket word, words, owner): a
    shard whole (sharded buckets; owner 0), else its HF tensors' rows as they lie in its TP1 tensor
    (`Mapping.tp1_hf_rows`) cut where the bucket's tensors begin (owner: the tensor's entry). None where a
    parameter's HF tensors are not rows of it, or a run begins or ends inside a word. Derived once per bucket."""
    key = ("copy runs", dims, itemsize)
    if key not in bucket.memo:
        bucket.memo[key] = _plan_copy_runs(bucket, dims, itemsize)
    return bucket.memo[key]


def _plan_copy_runs(bucket: Bucket, dims, itemsize: int) -> Optional[tuple]:
    starts = [entry.offset for entry in bucket.entries]
    plan = []
    for p in bucket.params:
        shape = tuple(p.meta.shape)
        if bucket.sharded:
            runs = [(0, p.offset, p.numel, 0)]
        else:
            rows = p.mapping.tp1_hf_rows(dims, shape[0], "cpu") if shape else None
            if rows is None:
                return None
            row, at, runs = math.prod(shape[1:]), p.offset, []
            for first, count in _row_runs(rows):
                runs += _cut(first * row, at, count * row, starts)
                at += count * row
            if at != p.offset + p.hf_numel:
                return None
        in_bytes = [(first * itemsize, at * itemsize, count * itemsize, owner) for first, at, count, owner in runs]
        if any(value % 8 for run in in_bytes for value in run[:3]):
            return None
        plan.append(tuple((first, at // 8, count // 8, owner) for first, at, count, owner in in_bytes))
    return tuple(plan)


def _row_runs(rows) -> list[tuple[int, int]]:
    """(first row, rows) of each run of consecutive rows in `rows` (a prefix `range`, or an index tensor)."""
    if isinstance(rows, range):  # `Mapping.tp1_hf_rows` gives `range(n)`: one run
        return [(rows.start, len(rows))]
    runs: list[list[int]] = []
    for row in rows.tolist():
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, 1])
    return [tuple(run) for run in runs]


def _cut(first: int, at: int, count: int, starts: list[int]) -> list[tuple[int, int, int, int]]:
    """A run of `count` elements from source element `first` to bucket element `at`, cut where the bucket's
    tensors begin (`starts`): (first, at, count, tensor index) each."""
    index, runs = bisect.bisect_right(starts, at) - 1, []
    while count:
        upper = starts[index + 1] if index + 1 < len(starts) else at + count
        take = min(count, upper - at)
        runs.append((first, at, take, index))
        first, at, count, index = first + take, at + take, count - take, index + 1
    return runs


def _pack_batched(bucket: Bucket, local_params: dict, dims, buf: torch.Tensor) -> None:
    """`pack_bucket` in few launches, where the one launch cannot (no Triton, a run off a word). On a GPU each
    copy is a kernel launch whose CPU cost (Python, dispatch: ~50 µs an HF tensor on an H200 under gVisor) far
    exceeds its GPU time: `benchmarks/sync_device.py`'s sync of 255 tensors took 10.5 ms copied one by one,
    6.1 ms batched. Whole runs of rows (a TP shard; HF tensors
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
    batched: Optional[bool] = None,
) -> FlatBucket:
    """The flat bucket of HF tensors from the gathered buffer [rows * local_numel] (rows: TP size, or 1).

    Sharded buckets are written into `out` (a flat buffer of ≥ `bucket.hf_numel` elements,
    allocated when None); a bucket that `arrives_flat` (replicated, or one parameter whose shards
    in order are its HF tensor) is the start of the gathered buffer itself. `own` = (row,
    local_params): that row of a sharded bucket was never packed (a rollout rank that is itself a
    TP rank of the bucket's stage); its shards are read from the parameters themselves, which
    saves copying this rank's share twice. `batched` (default: on a GPU): in one Triton launch that also
    takes the bucket's checksums (`unpack_runs.unpack_in_one_launch`; the FlatBucket's `sums`) where it can,
    else one copy per shard and HF tensor by its mapping's rule.
    """
    if bucket.arrives_flat:
        return FlatBucket(gathered[: bucket.hf_numel], bucket.entries)
    if out is None:
        out = torch.empty(bucket.hf_numel, dtype=gathered.dtype, device=gathered.device)
    if gathered.is_cuda if batched is None else batched:
        sums = unpack_in_one_launch(bucket, gathered, dims, out, own)
        if sums is not None:
            return FlatBucket(out[: bucket.hf_numel], bucket.entries, sums=sums)
    return _unpack_by_rules(bucket, gathered, dims, out, own)


def _unpack_by_rules(bucket: Bucket, gathered: torch.Tensor, dims, out: torch.Tensor, own) -> FlatBucket:
    """`unpack_bucket` of a sharded bucket, each HF tensor written by its mapping's rule (`Mapping.unshard_to_hf`)."""
    rows = gathered.view(bucket.tp_size, bucket.local_numel)
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
