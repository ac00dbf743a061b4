"""A sharded bucket's unpack on a GPU in one Triton launch: the TP rows → the flat bucket of HF tensors, summed.

Owns: `unpack_in_one_launch`. `pack.unpack_bucket` writes each HF tensor by its mapping's rule
(`Mapping.unshard_to_hf`): a copy per TP shard and HF tensor (QKV per shard and q/k/v, gate/up per shard, a
concatenation per row-parallel weight), each a kernel launch whose CPU cost (~20 µs on an H200) far exceeds its
GPU time: at TP 8 a 1.5 B model's unpack was 1,120 copies and 0.05× a device copy (`benchmarks/unpack_device.py`).

Every rule only moves elements, so the unpack is one fixed permutation per bucket layout. It is derived once, by
the rules themselves, one parameter at a time: its rule unpacks shards of element indices (int32, on the bucket's
device) instead of weights, and the result says where each output element comes from (`_param_runs`; the
temporaries are a few times that parameter's bytes, not the bucket's). Consecutive 8-byte words from consecutive
source words become runs, cut where a source row or a destination tensor changes; each run is a segment of
`devicesum.copy_sums`, which copies every run and sums the words per HF tensor in one launch (the bucket's
`protocol.checksums`, for a verifying sender to send as they are).

The runs name their sources relative to a base per TP row (the gathered buffer's rows) or, for the rollout rank's
own row (`own`, never packed), per parameter: the absolute addresses are taken per sync from those bases on the
device (kept while the bases stay the same). None, with nothing written, where a run is off an 8-byte word, a
parameter of the own row is not as planned, a mapping is of a class other than megarl's own four (whose rules only
move elements), or the kernel cannot run here: the caller keeps the rules.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megarl.models.mapping import GateUpMapping, Mapping, QKVMapping, VocabMapping
from megarl.rollout.sharding import devicesum
from megarl.rollout.sharding.plan import Bucket

_MOVES = (Mapping, VocabMapping, QKVMapping, GateUpMapping)  # rules that only move elements: traceable
_CHUNK = 1 << 24  # words checked per step: bounds that step's temporaries
_WORD = 8
logger = logging.getLogger(__name__)


def unpack_in_one_launch(
    bucket: Bucket, gathered: torch.Tensor, dims, out: torch.Tensor, own: Optional[tuple[int, dict]]
) -> Optional[torch.Tensor]:
    """`out[:hf_numel]` written from `gathered` ([tp_size * local_numel]; `own`'s row read from its parameters)
    as the mapping rules would write it (`pack._unpack_by_rules`); the per-tensor checksums of what was written.
    None, with nothing written, where the one launch does not apply."""
    itemsize = gathered.element_size()
    if not _fits(bucket, gathered, out):
        return None
    if not devicesum.available(gathered.device, "piece_copy_sums"):
        return None
    if any(type(p.mapping) not in _MOVES for p in bucket.params):
        return None  # a mapping class of its own (a new architecture's) may do more than move elements
    own_row = None if own is None else own[0]
    bases = _bases(bucket, gathered, own)
    if bases is None:
        return None
    key = ("unpack runs", dims, itemsize, own_row, str(gathered.device))
    if key not in bucket.memo:
        bucket.memo[key] = _derive(bucket, dims, gathered.device, itemsize, own_row)
    runs = bucket.memo[key]
    if runs is None:
        return None
    table = _table(bucket, key, runs, bases)
    words = out.view(torch.uint8)[: bucket.hf_numel * itemsize].view(torch.int64)
    try:
        return devicesum.copy_sums(words, table, len(bucket.entries))
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - Triton failing to build or run the kernel on this GPU
        devicesum.disable(err, "piece_copy_sums")
        return None


def _fits(bucket: Bucket, gathered: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the buffers are what the launch reads and writes by address: `gathered` exactly the TP rows,
    `out` room for the flat bucket, both contiguous, of one dtype, on 8-byte words."""
    itemsize = gathered.element_size()
    if _WORD % itemsize or out.dtype != gathered.dtype or out.device != gathered.device:
        return False
    if gathered.numel() != bucket.tp_size * bucket.local_numel or out.numel() < bucket.hf_numel:
        return False
    if not (gathered.is_contiguous() and out.is_contiguous()):
        return False
    return gathered.data_ptr() % _WORD == 0 and out.data_ptr() % _WORD == 0


def _bases(bucket: Bucket, gathered: torch.Tensor, own: Optional[tuple[int, dict]]) -> Optional[tuple[int, ...]]:
    """The byte address each run's source offset counts from: one per TP row of `gathered`, then, with `own`,
    one per parameter of the bucket (its address less its offset in the row). None where a parameter of the
    own row is not a plain contiguous tensor of its planned shape, dtype and device, on an 8-byte word."""
    itemsize, row_bytes = gathered.element_size(), bucket.local_numel * gathered.element_size()
    bases = [gathered.data_ptr() + row * row_bytes for row in range(bucket.tp_size)]
    if own is None:
        return tuple(bases)
    for p in bucket.params:
        src = own[1][(p.meta.vp_stage, p.meta.name)]
        if not devicesum.readable(src, p.meta.shape, gathered):
            return None
        bases.append(src.data_ptr() - p.offset * itemsize)
    return tuple(bases)


def _derive(bucket: Bucket, dims, device: torch.device, itemsize: int, own_row: Optional[int]) -> Optional[tuple]:
    """The pieces (base index, source word from the base, destination word, words, tensor) of the whole bucket,
    derived once per bucket layout, parameter by parameter; None where a run is off a word or the temporaries do
    not fit on the device (that bucket then keeps the rules)."""
    per = _WORD // itemsize
    bounds = [e.offset for e in bucket.entries] + [e.numel for e in bucket.entries]
    if bucket.hf_numel % per or bucket.local_numel % per or any(b % per for b in bounds):
        return None
    entry_starts = torch.tensor([e.offset // per for e in bucket.entries], dtype=torch.int64, device=device)
    parts, cursor = [], 0
    try:
        for index, p in enumerate(bucket.params):
            part = _param_runs(bucket, index, dims, device, per, own_row, cursor, entry_starts)
            if part is None:
                return None
            parts.append(part)
            cursor += p.hf_numel
    except torch.cuda.OutOfMemoryError as err:
        logger.warning(
            "bucket %d: no memory to derive its one-launch unpack (%s); it keeps the rules", bucket.index, err
        )
        return None
    return _pieces(*(torch.cat(column) for column in zip(*parts)))


def _param_runs(bucket: Bucket, index: int, dims, device, per: int, own_row, cursor: int, entry_starts):
    """Parameter `index`'s runs (base index, source word from it, destination word, words, tensor): its rule
    applied to shards of element indices into the gathered rows."""
    p = bucket.params[index]
    if p.offset % per or p.numel % per:
        return None
    n = bucket.tp_size * bucket.local_numel
    dtype = torch.int32 if n < 2**31 else torch.int64
    with torch.no_grad():
        step = torch.arange(p.numel, dtype=dtype, device=device)
        shards = [(step + (row * bucket.local_numel + p.offset)).view(p.meta.shape) for row in range(bucket.tp_size)]
        del step
        traced = torch.full((p.hf_numel,), -1, dtype=dtype, device=device)
        p.mapping.unshard_to_hf(shards, dims, traced)
        del shards
        source = _source_words(traced, per, n)
        del traced
    if source is None:
        return None
    row_words = bucket.local_numel // per
    row = source // row_words
    segment = row if own_row is None else torch.where(row == own_row, bucket.tp_size + index, row)
    del row
    dst = torch.arange(cursor // per, (cursor + p.hf_numel) // per, dtype=torch.int64, device=device)
    owner = torch.bucketize(dst, entry_starts, right=True) - 1
    cut = torch.ones(dst.numel(), dtype=torch.bool, device=device)
    cut[1:] = (source[1:] != source[:-1] + 1) | (segment[1:] != segment[:-1]) | (owner[1:] != owner[:-1])
    first = torch.nonzero(cut).view(-1)
    counts = torch.diff(first, append=torch.tensor([dst.numel()], device=device))
    return segment[first], source[first] % row_words, dst[first], counts, owner[first]


def _source_words(traced: torch.Tensor, per: int, n: int) -> Optional[torch.Tensor]:
    """Per output word, the gathered buffer's word it is (int64); None where an output word is not one whole
    source word of the `n` elements (or holds an element no rule wrote): no run may read outside the rows."""
    words = traced.numel() // per
    source = torch.empty(words, dtype=torch.int64, device=traced.device)
    step = torch.arange(per, dtype=traced.dtype, device=traced.device)
    for start in range(0, words, _CHUNK):
        block = traced[start * per : (start + _CHUNK) * per].view(-1, per)
        first = block[:, 0]
        whole = (first % per == 0) & (first >= 0) & (first <= n - per) & (block == first[:, None] + step).all(1)
        if not bool(whole.all()):
            return None
        source[start : start + block.shape[0]] = first.to(torch.int64) // per
    return source


def _pieces(segment, rel, first, counts, owner) -> tuple[torch.Tensor, ...]:
    """The runs cut into pieces of at most `devicesum.PIECE` words (one Triton program each)."""
    piece = devicesum.PIECE
    per_run = (counts + piece - 1) // piece
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), per_run)
    done = (torch.arange(run.numel(), device=counts.device) - (torch.cumsum(per_run, 0) - per_run)[run]) * piece
    return segment[run], rel[run] + done, first[run] + done, torch.clamp(counts[run] - done, max=piece), owner[run]


def _table(bucket: Bucket, key, runs: tuple, bases: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """`copy_sums`' table: the runs' source addresses from this sync's bases (kept while they stay the same)."""
    kept = bucket.memo.get(("unpack table",) + key)
    if kept is None or kept[0] != bases:
        segment, rel, first, counts, owner = runs
        base = torch.tensor(bases, dtype=torch.int64).to(segment.device)
        kept = bucket.memo[("unpack table",) + key] = (bases, (base[segment] + _WORD * rel, first, counts, owner))
    return kept[1]
