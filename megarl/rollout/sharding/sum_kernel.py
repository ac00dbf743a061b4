"""The Triton kernels of `devicesum` (imported only where a GPU bucket is summed or packed: it imports Triton)."""

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


@triton.jit
def piece_copy_sums(addresses, words, starts, counts, owners, sums, BLOCK: tl.constexpr):
    """Program i: counts[i] words copied from the address addresses[i] to words[starts[i]:], their sum added
    into sums[owners[i]] (the words as they are written: one read and one write of each)."""
    piece = tl.program_id(0)
    source = tl.load(addresses + piece).to(tl.pointer_type(tl.int64))
    start = tl.load(starts + piece)
    count = tl.load(counts + piece)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for first in range(0, count, BLOCK):
        index = first + offsets
        mask = index < count
        word = tl.load(source + index, mask=mask, other=0)
        tl.store(words + start + index, word, mask=mask)
        total += word
    tl.atomic_add(sums + tl.load(owners + piece), tl.sum(total, axis=0))
