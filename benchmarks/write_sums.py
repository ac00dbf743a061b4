"""Benchmark: a bucket's checksums taken by its writers as they write it, against the sender reading it again.

    python benchmarks/write_sums.py          # one thread, 15 rounds, ~5 s

Two TP2 layers of `benchmarks/weight_sync.py`'s Llama (hidden 768, FFN 2048, 12 heads, 4 KV heads; fp32: a
48 MiB bucket of 14 HF tensors: q/k/v, o, gate/up, down), each TP rank's shards written into the flat bucket
in HF layout by the mapping's own `shard_to_hf` (what a TP rank does over shared memory: `transport`):
  * write          — one rank's share (half the bucket; row-parallel shards land strided), plain `copy_`s;
  * write+sums     — the same under `writesums.WriteSums`: each copy made by `copysum.copy_rows_sum`, its
                     per-tensor word sums taken as it copies;
  * checksums      — `protocol.checksums` of the whole bucket (what the sender does without the writers' sums).
Checks first that the two ranks' sums add up to the bucket's checksums. Prints each one's time (min and median)
and the ratio the change is about: (2 x write + checksums) / (2 x write+sums), the CPU a bucket costs
before / after (above 1: the writers' sums cost less than the sender's read they replace).
"""

import time
import types

import torch

from megarl.models.mapping import GateUpMapping, Mapping, QKVMapping
from megarl.rollout.sharding.plan import HFSlot
from megarl.rollout.sharding.protocol import FlatBucket, checksums
from megarl.rollout.sharding.writesums import WriteSums

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 768, 2048, 12, 4, 64


def layer_params():
    """(mapping, mcore full shape, HF (name, shape) list) of one layer's four weights."""
    qkv_rows = KV_HEADS * (HEADS // KV_HEADS + 2) * HEAD_DIM
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return [
        (
            QKVMapping("qkv", ("q", "k", "v")),
            (qkv_rows, HIDDEN),
            [("q", (q, HIDDEN)), ("k", (kv, HIDDEN)), ("v", (kv, HIDDEN))],
        ),
        (Mapping("o", ("o",), tp_dim=1), (HIDDEN, q), [("o", (HIDDEN, q))]),
        (GateUpMapping("fc1", ("gate", "up")), (2 * FFN, HIDDEN), [("gate", (FFN, HIDDEN)), ("up", (FFN, HIDDEN))]),
        (Mapping("down", ("down",), tp_dim=1), (HIDDEN, FFN), [("down", (HIDDEN, FFN))]),
    ]


def main() -> None:
    torch.set_num_threads(1)
    dims = types.SimpleNamespace(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_heads=HEADS)
    params = layer_params() * 2
    entries, offset = [], 0
    for layer, (_, _, hf) in enumerate(params):
        for name, shape in hf:
            entries.append(HFSlot(f"{layer // 4}.{name}", shape, offset))
            offset += torch.Size(shape).numel()
    entries, flat = tuple(entries), torch.zeros(offset)
    generator = torch.Generator().manual_seed(0)
    shards = []  # each rank's shard of every parameter (rank 1 writes the same tensors: the time is what counts)
    for mapping, full, _ in params:
        shape = list(full)
        shape[mapping.tp_dim] //= 2
        shards.append(torch.randn(shape, generator=generator))

    def write(rank):
        cursor = 0
        for (mapping, _, hf), shard in zip(params, shards):
            numel = sum(torch.Size(shape).numel() for _, shape in hf)
            mapping.shard_to_hf(shard, rank, 2, dims, flat[cursor : cursor + numel])
            cursor += numel

    def summed(rank):
        with WriteSums(flat.data_ptr(), flat.untyped_storage().data_ptr(), entries, flat.element_size()) as sums:
            write(rank)
        return sums.result()

    messages = [summed(0), summed(1)]
    assert all(int(m[0]) == 1 for m in messages), "a write was not summed"
    assert torch.equal((messages[0] + messages[1])[1:], checksums(FlatBucket(flat, entries))), "sums differ"
    print(f"bucket {flat.numel() * 4 / 2**20:.0f} MiB, {len(entries)} tensors; the writers' sums add up: True")
    paths = {
        "write": lambda: write(0),
        "write+sums": lambda: summed(0),
        "checksums": lambda: checksums(FlatBucket(flat, entries)),
    }
    times = {name: [] for name in paths}
    for _ in range(15):  # alternate, so machine load hits all alike
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        ts.sort()
        print(f"  {name:12s} min {ts[0] * 1e3:6.2f} ms   median {ts[len(ts) // 2] * 1e3:6.2f} ms")
    best = {name: min(ts) for name, ts in times.items()}
    ratio = (2 * best["write"] + best["checksums"]) / (2 * best["write+sums"])
    print(f"CPU per bucket, sender's checksums / writers' sums: {ratio:.2f}x")


if __name__ == "__main__":
    main()
