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

Then what the vLLM CPU worker does with a bucket whose tensors are its parameters already (adopted: from the
third sync on the trainer's ranks write the model, the worker only checks it), for the quickstart's model (26
HF tensors, 1.3 MiB of fp32):
  * adopted, per tensor — `PendingCheck.check_in_place` with nothing to defer to: a `checksums` call per tensor
                          (the worker before 2026-11-28);
  * adopted, per bucket — the checks deferred to the bucket's end (`FlatBucket.pending(in_place=...)`), then
                          one `protocol.check_in_place` for all of them.
"""

import time

import torch

from megarl.rollout.sharding import copysum
from megarl.rollout.sharding.plan import HFSlot
from megarl.rollout.sharding.protocol import FlatBucket, check_in_place, checksums, verify_bucket

SHAPES = [(1024, 1024)] * 4 + [(4096, 1024)]  # 32 MiB of fp32
# the quickstart's tiny Qwen2 as HF tensors: embedding (tied), per layer q/k/v weights and biases, o, gate, up,
# down, two norms; the final norm
_LAYER = [(128, 128), (128,), (128, 128), (128,), (128, 128), (128,), (128, 128), (256, 128), (256, 128)]
QUICKSTART_SHAPES = [(103, 128)] + (_LAYER + [(128, 256), (128,), (128,)]) * 2 + [(128,)]


def make_bucket(shapes=SHAPES) -> FlatBucket:
    entries, offset = [], 0
    for i, shape in enumerate(shapes):
        entries.append(HFSlot(f"t{i}", shape, offset))
        offset += torch.Size(shape).numel()
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
    times = alternating(forms, 30)
    print(
        f"one bucket of {bucket.buffer.numel() * 4 / 2**20:.0f} MiB, {len(SHAPES)} tensors; one pass native: "
        f"{copysum.available()}"
    )
    print_times(times, width=16, digits=2)
    best = {name: runs[0] for name, runs in times.items()}
    print(
        f"check-then-copy / copy-and-check: {best['check-then-copy'] / best['copy-and-check']:.2f}x   "
        f"copy-and-check / copy: {best['copy-and-check'] / best['copy']:.2f}x"
    )

    adopted_checks()


def adopted_checks() -> None:
    """The worker's check of a bucket that is its model already: a sum per tensor, against one per bucket."""
    bucket = make_bucket(QUICKSTART_SHAPES)
    received = verify_bucket(bucket, checksums(bucket))

    def per_tensor():
        for _, _, check in received.pending():
            check.check_in_place()

    def per_bucket():
        later: list[int] = []
        for _, _, check in received.pending(later):
            check.check_in_place()
        check_in_place(received, later)

    forms = {"adopted, per tensor": per_tensor, "adopted, per bucket": per_bucket}
    times = alternating(forms, 300)
    print(f"one bucket of {bucket.buffer.numel() * 4 / 2**20:.1f} MiB, {len(QUICKSTART_SHAPES)} tensors, adopted:")
    print_times(times, width=20, digits=3)
    median = {name: runs[len(runs) // 2] for name, runs in times.items()}
    print(f"per tensor / per bucket: {median['adopted, per tensor'] / median['adopted, per bucket']:.2f}x")


def alternating(forms: dict, rounds: int) -> dict[str, list[float]]:
    """Each form's seconds over `rounds` rounds, sorted; the forms take turns in every round, so the machine's
    load hits every form alike."""
    times = {name: [] for name in forms}
    for _ in range(rounds):
        for name, form in forms.items():
            start = time.perf_counter()
            form()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(runs) for name, runs in times.items()}


def print_times(times: dict[str, list[float]], width: int, digits: int) -> None:
    for name, runs in times.items():
        low, mid = runs[0] * 1e3, runs[len(runs) // 2] * 1e3
        print(f"  {name:{width}s} min {low:6.{digits}f} ms   median {mid:6.{digits}f} ms")


if __name__ == "__main__":
    main()
