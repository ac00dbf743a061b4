"""The Triton kernel of `devicesum.span_sums` (imported only where a GPU bucket is summed: it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def piece_sums(words, starts, counts, owners, sums, BLOCK: tl.constexpr):
    """Program i: the sum of words[starts[i] : starts[i] + counts[i]], added into sums[owners[i]]."""
    piece = tl.program_id(0)
    start = tl.load(starts + piece)
    count = tl.load(counts + piece)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for first in range(0, count, BLOCK):
        index = first + offsets
        total += tl.load(words + start + index, mask=index < count, other=0)
    tl.atomic_add(sums + tl.load(owners + piece), tl.sum(total, axis=0))
