"""Checksums taken by a bucket's writers as they write it (`writesums.WriteSums`, `copysum.copy_rows_sum`).

Writers that each fill part of a flat bucket (column blocks of odd widths, so rows begin inside words;
contiguous copies that run across tensors and past the bucket's end) sum what they write; added up, the sums
equal `protocol.checksums` of the bucket, and the bytes land as `copy_` would put them. A write the mode
cannot sum (an `out=`, rows that cross a tensor's end, an in-place op, a `_foreach_` copy) makes its sums incomplete. The
sharding manager's use (every bucket of a TP2×PP2 actor over shared memory) is checked in
`test_sync_embedded.py`.
"""

import pytest
import torch

from megarl.rollout.sharding import copysum
from megarl.rollout.sharding.plan import HFSlot
from megarl.rollout.sharding.protocol import FlatBucket, checksums
from megarl.rollout.sharding.writesums import WriteSums

pytestmark = pytest.mark.skipif(not copysum.available(), reason="no C compiler for the one-pass copy")

SHAPES = [("a", (6, 12)), ("b", (4, 6)), ("c", (3, 8))]  # 72, 24 and 24 elements: word-aligned in any dtype


def _bucket(dtype=torch.bfloat16, spare=0):
    entries, offset = [], 0
    for name, shape in SHAPES:
        entries.append(HFSlot(name, shape, offset))
        offset += torch.Size(shape).numel()
    buffer = torch.zeros(offset + spare, dtype=dtype)
    return buffer, tuple(entries)


def _view(buffer, entry):
    return buffer[entry.offset : entry.offset + entry.numel].view(entry.shape)


def _summing(buffer, entries):
    return WriteSums(buffer.data_ptr(), buffer.untyped_storage().data_ptr(), entries, buffer.element_size())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_the_writers_sums_add_up_to_the_buckets_checksums(dtype):
    generator = torch.Generator().manual_seed(0)
    buffer, entries = _bucket(dtype, spare=5)
    full = {e.name: torch.randint(-100, 100, e.shape, generator=generator).to(dtype) for e in entries}
    a, b, c = (_view(buffer, e) for e in entries)
    results = []
    with _summing(buffer, entries) as first:  # columns 0..2 of `a` (rows start mid-word), then b's first 3 rows
        a[:, :3].copy_(full["a"][:, :3])
        b[:3].copy_(full["b"][:3])
    results.append(first.result())
    with _summing(buffer, entries) as second:  # columns 3..11 of `a`; b's last row, all of c and the spare
        a[:, 3:].copy_(full["a"][:, 3:].clone())  # a contiguous source into strided rows
        tail = torch.cat([full["b"][3:].flatten(), full["c"].flatten(), torch.ones(5, dtype=dtype)])
        buffer[b.storage_offset() + 18 :].copy_(tail)  # one contiguous copy across b|c and past the end
    results.append(second.result())
    assert all(int(r[0]) == 1 for r in results)
    for e in entries:
        assert torch.equal(_view(buffer, e), full[e.name])
    expected = checksums(FlatBucket(buffer[: sum(e.numel for e in entries)], entries))
    assert torch.equal(torch.stack(results).sum(0)[1:], expected)
    assert not torch.equal(results[0][1:], expected)  # each writer summed only its own bytes


def test_strided_sources_and_rows_inside_words_land_as_copy_would_put_them():
    generator = torch.Generator().manual_seed(1)
    buffer, entries = _bucket()
    source = torch.randn(6, 20, generator=generator).to(torch.bfloat16)[:, 5:17]  # rows at a stride of 20
    with _summing(buffer, entries) as sums:
        _view(buffer, entries[0]).copy_(source)
    assert torch.equal(_view(buffer, entries[0]), source)
    only_a = FlatBucket(buffer[: entries[0].numel], entries[:1])
    assert int(sums.result()[1]) == int(checksums(only_a)[0])


def test_writes_it_cannot_sum_make_the_sums_incomplete():
    buffer, entries = _bucket()
    a, b = _view(buffer, entries[0]), _view(buffer, entries[1])
    writes = {
        "cat into the bucket": lambda: torch.cat([torch.ones(3, 12, dtype=torch.bfloat16)] * 2, out=a),
        "rows across a tensor's end": lambda: (
            buffer[66:90].view(4, 6)[:, :3].copy_(torch.ones(4, 3, dtype=torch.bfloat16))
        ),
        "an in-place op": lambda: b.mul_(2),
        "a foreach copy (the GPU's batched pack)": lambda: torch._foreach_copy_([b], [torch.ones(4, 6, dtype=b.dtype)]),
        "a dtype conversion": lambda: b.copy_(torch.ones(4, 6)),
    }
    for what, write in writes.items():
        with _summing(buffer, entries) as sums:
            write()
        assert int(sums.result()[0]) == 0, what
    unaligned = WriteSums(buffer.data_ptr() + 2, buffer.untyped_storage().data_ptr(), entries, 2)
    assert int(unaligned.result()[0]) == 0  # a bucket that does not start on a word: its words are not ours to sum
    with _summing(buffer, entries) as sums:  # writes elsewhere do not count
        torch.ones(3).mul_(2)
        torch.zeros(4).copy_(torch.ones(4))
    assert int(sums.result()[0]) == 1 and not sums.result()[1:].any()
