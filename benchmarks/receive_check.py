"""Benchmark: a received bucket checked as it is copied into the engine, against checked and then copied.

    python benchmarks/receive_check.py          # one thread, 30 rounds, ~3 s

What a broadcast receiver's embedded engine does with each bucket after the first (CPU): the bucket (32 MiB of
fp32, five tensors of `benchmarks/weight_sync.py`'s sizes) arrives with the sender's per-tensor checksums.
  * check-then-copy — `FlatBucket.tensors()` (its checksums read the whole bucket and compare) then a `copy_`
                      per tensor into the engine's parameters: the receiver before 2026-11-27;
  * copy-and-check  — `PendingCheck.copy_into` per tensor: `copysum` copies and sums it in one pass, then
                      compares (`protocol.pending_tensors`, what `EmbeddedEngine.load_checked` gets);
  * copy            — the `copy_`s alone, unverified (the floor).
Checks first that every form leaves the parameters equal to the bucket. Prints min and median of each and the
ratios check-then-copy / copy-and-check (the saving) and copy-and-check / copy (the check's cost left).
"""

import time

import torch

from megarl.rollout.sharding import copysum
from megarl.rollout.sharding.plan import HFSlot
from megarl.rollout.sharding.protocol import FlatBucket, checksums, verify_bucket

SHAPES = [(1024, 1024)] * 4 + [(4096, 1024)]  # 32 MiB of fp32


def make_bucket() -> FlatBucket:
    entries, offset = [], 0
    for i, shape in enumerate(SHAPES):
        entries.append(HFSlot(f"t{i}", shape, offset))
        offset += shape[0] * shape[1]
    return FlatBucket(torch.randn(offset), tuple(entries))


def main() -> None:
    torch.set_num_threads(1)
    bucket = make_bucket()
    received = verify_bucket(bucket, checksums(bucket))
    params = [torch.empty(shape) for shape in SHAPES]

    def check_then_copy():
        for param, (_, tensor) in zip(params, received.tensors()):
            param.copy_(tensor)

    def copy_and_check():
        for param, (_, _, check) in zip(params, received.pending()):
            check.copy_into(param)

    def copy():
        for param, (_, tensor) in zip(params, bucket.tensors()):
            param.copy_(tensor)

    forms = {"check-then-copy": check_then_copy, "copy-and-check": copy_and_check, "copy": copy}
    for form in forms.values():
        for param in params:
            param.zero_()
        form()
        assert all(torch.equal(p, t) for p, (_, t) in zip(params, bucket.tensors()))
    times = {name: [] for name in forms}
    for _ in range(30):  # alternating: the machine's load hits every form alike
        for name, form in forms.items():
            start = time.perf_counter()
            form()
            times[name].append(time.perf_counter() - start)
    print(
        f"one bucket of {bucket.buffer.numel() * 4 / 2**20:.0f} MiB, {len(SHAPES)} tensors; one pass native: "
        f"{copysum.available()}"
    )
    for name, runs in times.items():
        runs.sort()
        print(f"  {name:16s} min {runs[0] * 1e3:6.2f} ms   median {runs[len(runs) // 2] * 1e3:6.2f} ms")
    best = {name: runs[0] for name, runs in times.items()}
    print(
        f"check-then-copy / copy-and-check: {best['check-then-copy'] / best['copy-and-check']:.2f}x   "
        f"copy-and-check / copy: {best['copy-and-check'] / best['copy']:.2f}x"
    )


if __name__ == "__main__":
    main()
