"""Checksums taken by the ranks that write a bucket, as they write it: the sender then sums nothing.

Owns: `WriteSums`. A bucket's integrity check (`protocol.checksums`) is, per tensor, the wrapping int64 sum
of the 8-byte words holding its bytes. That sum is linear: the sum over a word of the bytes one writer
filled (every other byte of the word read as zero) plus another writer's part of the same word is the
word. So when the TP ranks of a replica write a bucket straight into the rollout rank's shared memory
(`transport`, `shm`), each can sum what it writes while it copies it (`copysum.copy_rows_sum`: one pass),
send its per-tensor sums with its "written", and the rollout rank adds them up: the bucket's checksums,
without the sender reading the bucket again before it goes (`benchmarks/write_sums.py`: the writers' sums
cost 1.18–1.37x less CPU per bucket than that read).

`WriteSums` is a torch function mode: while it is active, every `copy_` into the bucket's memory is made by
`copysum` and summed into its tensor, if it is a plain copy (same dtype and shape, each side rows of
contiguous elements at one stride) that lies within one tensor of the bucket (one contiguous run may span
several; bytes past the bucket's end count for none). Anything else that writes into the bucket's memory
(another in-place op, an `out=`, a copy it cannot make) makes the sums incomplete: `result()` says so and
the sender takes the checksums itself, as before (as it does with `MEGARL_WRITE_SUMS=0`). A wrong sum
cannot pass silently either: the receiver checks the bytes it got against it, and a mismatch fails the
update.
"""

from __future__ import annotations

import bisect
import os
from typing import Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from megarl.rollout.load_plan import writes_into
from megarl.rollout.sharding import copysum
from megarl.rollout.sharding.plan import HFSlot

MIN_BUCKET_BYTES = 1 << 20
"""Smaller buckets are summed by the sender as before: there the mode's Python per copy costs about what the
read it saves does (a small model's sync is latency-bound: the quickstart's whole model is 1.4 MB)."""


def enabled() -> bool:
    """Whether writers sum what they write: the one-pass copy is here and `MEGARL_WRITE_SUMS` is not 0."""
    return os.environ.get("MEGARL_WRITE_SUMS", "1") != "0" and copysum.available()


class WriteSums(TorchFunctionMode):
    """Sums, per tensor of a flat bucket, the bytes written into it by `copy_` while active.

    base_ptr: the address of the bucket's first byte in this process (the start of its flat buffer);
    storage_ptr: the data pointer of the storage that holds it (writes into it are watched).
    """

    def __init__(self, base_ptr: int, storage_ptr: int, entries: Sequence[HFSlot], itemsize: int):
        super().__init__()
        self.base, self.storage = base_ptr, storage_ptr
        self.starts = [e.offset * itemsize for e in entries]
        self.end = (entries[-1].offset + entries[-1].numel) * itemsize if entries else 0
        self.sums = [0] * len(entries)
        # else every copy_ goes to torch and the sums are incomplete (words are 8-byte aligned from the start)
        self.complete = copysum.available() and base_ptr % 8 == 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.complete:
            if func is torch.Tensor.copy_ and self._ours(args[0]):
                if self._copy(args[0], args[1], kwargs):
                    return args[0]
                self.complete = False
            elif writes_into(func, args, kwargs, (self.storage,)):
                self.complete = False
        return func(*args, **kwargs)

    def result(self) -> torch.Tensor:
        """[1 if the sums are complete else 0, the per-tensor sums...] as int64 (the "written" message)."""
        sums = [_signed(s) for s in self.sums] if self.complete else [0] * len(self.sums)
        return torch.tensor([int(self.complete), *sums], dtype=torch.int64)

    def _ours(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() == self.storage

    def _copy(self, dst: torch.Tensor, src, kwargs) -> bool:
        """Make the copy with `copysum` and add its sums in; False where it is not a plain copy this can make."""
        if kwargs or not isinstance(src, torch.Tensor) or src.device.type != "cpu" or dst.device.type != "cpu":
            return False
        if src.dtype != dst.dtype or src.shape != dst.shape:
            return False
        if dst.numel() == 0:
            return True
        layout = _rows(dst, src)
        if layout is None:
            return False
        size = dst.element_size()
        rows, row, dst_stride, src_stride = layout[0], layout[1] * size, layout[2] * size, layout[3] * size
        start = dst.data_ptr() - self.base
        contiguous = rows == 1 or dst_stride == src_stride == row
        pieces = _pieces(start, rows, row, dst_stride, contiguous, self.starts, self.end)
        if pieces is None:
            return False
        for offset, count, length, entry in pieces:
            total = copysum.copy_rows_sum(
                dst.data_ptr() + offset, src.data_ptr() + offset, count, length, dst_stride, src_stride, start + offset
            )
            if entry is not None:  # None: past the bucket's end (padding rows), copied and counted for none
                self.sums[entry] = (self.sums[entry] + total) % (1 << 64)
        return True


def _rows(dst: torch.Tensor, src: torch.Tensor) -> Optional[tuple[int, int, int, int]]:
    """(rows, elements per row, dst row stride, src row stride), in elements, when both tensors (of one shape)
    are rows of contiguous elements at one stride each; None otherwise."""
    dims = [(n, a, b) for n, a, b in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    inner = 1
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:
        inner *= dims.pop()[0]
    if not dims:
        return 1, inner, inner, inner
    while len(dims) > 1:  # collapse outer dims that step evenly in both tensors
        (n1, a1, b1), (n2, a2, b2) = dims[-2], dims[-1]
        if a1 != a2 * n2 or b1 != b2 * n2:
            return None
        dims[-2:] = [(n1 * n2, a2, b2)]
    rows, dst_stride, src_stride = dims[0]
    return rows, inner, dst_stride, src_stride


def _pieces(start: int, rows: int, row: int, stride: int, contiguous: bool, starts: list[int], end: int):
    """A copy's bytes as (byte offset from its first byte, rows, bytes per row, tensor index or None past the
    bucket's end): rows at `stride` all inside one tensor, as one piece; `contiguous` bytes (on both sides)
    cut where tensors start and where the bucket ends. None where rows cross a tensor's boundary, or the copy
    starts outside the bucket."""
    if not 0 <= start < end:
        return None
    index = bisect.bisect_right(starts, start) - 1
    if not contiguous:
        upper = starts[index + 1] if index + 1 < len(starts) else end
        return [(0, rows, row, index)] if start + (rows - 1) * stride + row <= upper else None
    last, pieces, at = start + rows * row, [], start
    while at < last:
        if at >= end:
            pieces.append((at - start, 1, last - at, None))
            break
        upper = starts[index + 1] if index + 1 < len(starts) else end
        stop = min(last, upper)
        pieces.append((at - start, 1, stop - at, index))
        at, index = stop, index + 1
    return pieces


def _signed(total: int) -> int:
    return total - (1 << 64) if total >= 1 << 63 else total
