"""A sharded bucket's unpack on a GPU in one Triton launch: the TP rows → the flat bucket of HF tensors, summed.

Owns: `unpack_in_one_launch`. `pack.unpack_bucket` writes each HF tensor by its mapping's rule
(`Mapping.unshard_to_hf`): a copy per TP shard and HF tensor (QKV per shard and q/k/v, gate/up per shard, a
concatenation per row-parallel weight), each a kernel launch whose CPU cost (~20 µs on an H200) far exceeds its
GPU time: at TP 8 a 1.5 B model's unpack was 1,120 copies and 0.05× a device copy (`benchmarks/unpack_device.py`).

Every rule only moves elements, so the unpack is one fixed permutation per bucket layout. It is derived once, by
the rules themselves: they unpack a buffer of element indices (int32, on the bucket's device) instead of weights,
and the result says where each output element comes from (`_trace`). Consecutive 8-byte words from consecutive
source words become runs (`_runs`), cut where a source row, a parameter of the rank's own row or a destination
tensor changes; each run is a segment of `devicesum.copy_sums`, which copies every run and sums the words per
HF tensor in one launch (the bucket's `protocol.checksums`, for a verifying sender to send as they are).

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

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the launch reads by address
_MOVES = (Mapping, VocabMapping, QKVMapping, GateUpMapping)  # rules that only move elements: traceable
_CHUNK = 1 << 24  # words checked per step: bounds that step's temporaries
logger = logging.getLogger(__name__)


def unpack_in_one_launch(
    bucket: Bucket, gathered: torch.Tensor, dims, out: torch.Tensor, own: Optional[tuple[int, dict]], rules
) -> Optional[torch.Tensor]:
    """`out[:hf_numel]` written from `gathered` ([tp_size * local_numel]; `own`'s row read from its parameters)
    as `rules(bucket, gathered, dims, out, own)` would write it; the per-tensor checksums of what was written.
    None, with nothing written, where the one launch does not apply."""
    itemsize = gathered.element_size()
    if 8 % itemsize or gathered.data_ptr() % 8 or out.data_ptr() % 8 or out.dtype != gathered.dtype:
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
        bucket.memo[key] = _derive(bucket, dims, gathered.device, rules, itemsize, own_row)
    runs = bucket.memo[key]
    if runs is None:
        return None
    words = out.view(torch.uint8)[: bucket.hf_numel * itemsize].view(torch.int64)
    try:
        return devicesum.copy_sums(words, _table(bucket, key, runs, bases), len(bucket.entries))
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - Triton failing to build or run the kernel on this GPU
        devicesum.disable(err, "piece_copy_sums")
        return None


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
        if type(src) not in _PLAIN or tuple(src.shape) != tuple(p.meta.shape) or src.dtype != gathered.dtype:
            return None
        if src.device != gathered.device or not src.is_contiguous() or src.data_ptr() % 8:
            return None
        bases.append(src.data_ptr() - p.offset * itemsize)
    return tuple(bases)


def _derive(bucket: Bucket, dims, device: torch.device, rules, itemsize: int, own_row) -> Optional[tuple]:
    """`_runs` of the rules' permutation, derived once per bucket layout (about four times the bucket's bytes of
    temporaries on its device); None where they do not fit there: that bucket keeps the rules."""
    try:
        return _runs(bucket, _trace(bucket, dims, device, rules), itemsize, own_row)
    except torch.cuda.OutOfMemoryError as err:
        logger.warning(
            "bucket %d: no memory to derive its one-launch unpack (%s); it keeps the rules", bucket.index, err
        )
        return None


def _trace(bucket: Bucket, dims, device: torch.device, rules) -> torch.Tensor:
    """For every element of the flat bucket, the index of the element of the gathered buffer it comes from
    (-1: written by no rule): the rules applied to the indices themselves."""
    n = bucket.tp_size * bucket.local_numel
    dtype = torch.int32 if max(n, bucket.hf_numel) < 2**31 else torch.int64
    with torch.no_grad():
        index = torch.arange(n, dtype=dtype, device=device)
        traced = torch.full((bucket.hf_numel,), -1, dtype=dtype, device=device)
        rules(bucket, index, dims, traced, None)
    return traced


def _runs(bucket: Bucket, traced: torch.Tensor, itemsize: int, own_row: Optional[int]) -> Optional[tuple]:
    """The pieces (base index, source word from the base, destination word, words, tensor) of the permutation
    `traced`, on its device; None where an output word is not one whole source word, or a tensor or a parameter
    begins off a word."""
    per = 8 // itemsize
    offsets = [p.offset for p in bucket.params] + [e.offset for e in bucket.entries]
    if bucket.hf_numel % per or bucket.local_numel % per or any(o % per for o in offsets):
        return None
    if any(e.numel % per for e in bucket.entries):
        return None
    source = _source_words(traced, per, bucket.tp_size * bucket.local_numel)
    device = traced.device
    del traced  # the largest temporary
    if source is None:
        return None
    nwords, row_words = bucket.hf_numel // per, bucket.local_numel // per
    row, rel = source // row_words, source % row_words
    segment = row
    if own_row is not None:  # the own row's sources: its parameters, each from its own base
        starts = torch.tensor([p.offset // per for p in bucket.params], dtype=torch.int64, device=device)
        param = torch.bucketize(rel, starts, right=True) - 1
        segment = torch.where(row == own_row, bucket.tp_size + param, row)
    entry_starts = torch.tensor([e.offset // per for e in bucket.entries], dtype=torch.int64, device=device)
    owner = torch.bucketize(torch.arange(nwords, device=device), entry_starts, right=True) - 1
    cut = torch.ones(nwords, dtype=torch.bool, device=device)
    cut[1:] = (source[1:] != source[:-1] + 1) | (segment[1:] != segment[:-1]) | (owner[1:] != owner[:-1])
    first = torch.nonzero(cut).view(-1)
    counts = torch.diff(first, append=torch.tensor([nwords], device=device))
    return _pieces(segment[first], rel[first], first, counts, owner[first])


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
        kept = bucket.memo[("unpack table",) + key] = (bases, (base[segment] + 8 * rel, first, counts, owner))
    return kept[1]
