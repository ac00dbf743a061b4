"""Benchmark + check: the colocated in-process weight sync on one GPU, against a device copy.

    python benchmarks/sync_device.py                        # on a CUDA machine: a Qwen2-1.5B-sized Llama, bf16
    python benchmarks/sync_device.py --device cpu --quick   # the same code on CPU (gloo), seconds

What a colocated rollout rank does at TP1 each step (`ShardingManager.sync(InPlaceSender(engine, adopt=True))`),
with the embedded (`transformers`) engine on the same device: one rank (NCCL on a GPU) holds a megatron-core
Llama loaded from a random HF checkpoint; the sharding manager turns its parameters into HF tensors (QKV split
per group, gate/up split, vocabulary padding dropped) bucket by bucket, and the engine takes the buckets of its
first sync as its parameters, so every later sync writes into the model.

Checked before timing: the engine, its weights zeroed first, holds the bridge's HF export bit for bit after a
sync, again after every megatron weight changed (the second sync writes into the adopted buffers), and after a
sleep and wake-up (on a GPU the sleep gives the adopted buffers back; the next sync adopts new ones). Prints how
many bytes of the engine's parameters are the sync's buffers and, on a GPU, how much memory its sleep gave back.

Timed (best of --repeats, alternating, each ending with the device synchronized):
  * copy        — one `dst.copy_(src)` of the HF bytes (the memory floor);
  * gather      — `ShardingManager.iter_weights()` consumed, no engine (the HF tensors built, bucket by bucket;
                  on a GPU one Triton launch a bucket, `pack.pack_bucket_summed`);
  * gather + checksums — the same with each bucket's checksums, as a verified IPC sync's trainer side takes
                  them: the pack's own (on a GPU it sums what it writes), else read back (`protocol.checksums`);
  * gather, batched copies / gather + checksums, batched — both with the pack's earlier form (few launches a
                  bucket, `pack._pack_batched`, whose checksums are read back): the baseline of the one launch;
  * in-process  — the sync into the engine, awake since the last one (it writes into the buffers it adopted);
  * in-process after a wake-up — the same after the engine slept and woke (untimed): what each step's sync
                  is in colocated training, where the engine sleeps through the training phases (new buffers,
                  adopted; on CPU, where sleeping is a flag, the same as in-process).
Prints each one's GB/s and its ratio against `copy` (bytes/s; issue 17's goal for a sync: >= 0.5).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Optional

import torch
from ipc_device import print_rows, timed  # the sibling benchmark's timer (the device synchronized) and rows
from weight_sync import _consume  # the sibling benchmark's gather with no engine: `iter_weights()` consumed

from megarl.models.layout import ParallelLayout
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES


def model_config(quick: bool, dtype: torch.dtype):
    from megarl.testing.models import tiny_hf_config

    size = (
        dict(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=704)
        if quick
        else dict(
            vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960
        )
    )
    config = tiny_hf_config("llama", **size)
    config.torch_dtype = dtype
    return config


def write_checkpoint(path: str, quick: bool, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(quick, dtype), dtype=dtype).save_pretrained(path)


def bench_rank(
    hf_dir: str, device: str, dtype: torch.dtype, bucket_mb: float, repeats: int, profile: Optional[str] = None
) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.manager import ShardingManager
    from megarl.rollout.sharding.senders import sender_for

    layout = ParallelLayout()
    init_megatron(layout)
    bridge = ModelBridge.from_hf_path(hf_dir, layout, dtype=dtype)
    chunks = bridge.build(0)
    bridge.load_hf_weights(chunks, hf_dir, tp_rank=0, pp_rank=0)
    manager = ShardingManager(bridge, chunks, bucket_bytes=int(bucket_mb * 2**20))
    engine = EmbeddedEngine(hf_dir, dtype=dtype, device=device)
    sender = sender_for(engine, adopt=True)  # one for the run, as the rollout worker keeps it
    version = [0]

    def sync():
        version[0] += 1
        manager.sync(sender, version=version[0])

    def export() -> dict[str, torch.Tensor]:
        tp_group = ps.get_tensor_model_parallel_group()
        return {n: t.clone() for n, t in bridge.iter_hf_weights(chunks, pp_rank=0, tp_group=tp_group)}

    with torch.no_grad():
        for param in engine._params.values():
            param.zero_()
    sync()
    exact = [_equal(engine._params, export())]
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.add_(1.0)
    sync()
    exact.append(_equal(engine._params, export()))
    adopted = sum(t.numel() * t.element_size() for t in engine._params.values() if engine.update_buffers.holds(t))
    freed = _sleep_and_wake(engine, device)
    sync()  # after a wake-up the engine's parameters are new memory: this sync is adopted anew
    exact.append(_equal(engine._params, export()))
    hf_bytes = sum(t.numel() * t.element_size() for t in engine._params.values())
    src = torch.randn(hf_bytes // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    summed = _summed_gather(manager)
    sums_checked = summed()  # the one-launch pack's sums (GPU), else taken after: both checked here
    paths = {"copy": lambda: dst.copy_(src), "gather": _consume(manager), "gather + checksums": summed}
    paths |= {"gather, batched copies": _batched(_consume(manager)), "gather + checksums, batched": _batched(summed)}
    paths |= {"in-process": sync, "in-process after a wake-up": sync}  # after a wake-up: new buffers, adopted
    setups = {"in-process after a wake-up": lambda: _sleep_and_wake(engine, device)}  # not timed
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            setups.get(name, lambda: None)()
            best[name] = min(best[name], timed(device, fn))
    if profile:
        _profile(profile, device, {"gather + checksums": summed, "in-process": sync})
    return dict(
        best=best,
        sums_from_pack=sums_checked,
        exact=exact,
        hf_bytes=hf_bytes,
        buckets=len(manager.plan.buckets),
        tensors=len(engine._params),
        adopted=adopted,
        freed=freed,
    )


def _profile(path: str, device: str, paths: dict) -> None:
    """Where each path's CPU time goes (it is launch-bound on a GPU): cProfile's functions and torch.profiler's
    operators of three runs each, written to `path`."""
    import cProfile
    import io
    import pstats

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with open(path, "w") as out:
        for name, fn in paths.items():
            profiler = cProfile.Profile()
            profiler.runcall(lambda run=fn: [timed(device, run) for _ in range(3)])
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            out.write(f"== {name}: cProfile, 3 runs\n{text.getvalue()}\n")
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    timed(device, fn)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            out.write(f"== {name}: torch.profiler, 3 runs\n{table}\n")
    print(f"profile of {', '.join(paths)} written to {path}")


def _summed_gather(manager):
    """The trainer's side of a verified IPC sync: every bucket gathered with its checksums (those the pack took
    as it wrote the bucket, `pack.pack_bucket_summed`, else `protocol.checksums` read back, as `IpcChannel` takes
    them). Each call returns how many buckets came with the pack's sums, checked against a read-back."""
    from megarl.rollout.sharding.protocol import checksums

    def run() -> int:
        taken = 0
        for bucket in manager.iter_buckets():
            sums = bucket.sums if bucket.sums is not None else checksums(bucket)
            taken += bucket.sums is not None
            if check[0] and bucket.sums is not None and not torch.equal(bucket.sums, checksums(bucket)):
                raise SystemExit(f"the pack's checksums of bucket {bucket.entries[0].name}... differ from a read-back")
            sums.tolist()  # as the channel sends them: waits for the stream
        check[0] = False
        return taken

    check = [True]
    return run


def _batched(fn):
    """`fn` with the pack in few launches (`pack._pack_batched`, the form before the one launch): the baseline."""
    from unittest import mock

    from megarl.rollout.sharding import pack

    def run():
        with mock.patch.object(pack, "_pack_in_one_launch", lambda *args: None):
            return fn()

    return run


def _sleep_and_wake(engine, device: str) -> int:
    """Bytes of device memory the engine's sleep gave back (its adopted buckets included; 0 on CPU)."""
    before = torch.cuda.memory_allocated() if device != "cpu" else 0
    engine.sleep()
    freed = before - torch.cuda.memory_allocated() if device != "cpu" else 0
    engine.wake_up()
    return freed


def _equal(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    return params.keys() == reference.keys() and all(torch.equal(params[n], t) for n, t in reference.items())


def main() -> None:
    from megarl.utils.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a ~3M-parameter model")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", metavar="PATH", help="write cProfile and torch.profiler tables of two paths")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here; pass --device cpu")
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    with tempfile.TemporaryDirectory(prefix="megarl-sync-device-") as hf_dir:
        write_checkpoint(hf_dir, args.quick, dtype)
        result = run_distributed(bench_rank, 1, hf_dir, args.device, dtype, args.bucket_mb, args.repeats, args.profile)[
            0
        ]
    best, nbytes = result["best"], result["hf_bytes"]
    print(
        f"{args.device}: {nbytes / 2**20:.1f} MiB of {str(dtype).removeprefix('torch.')} HF weights,"
        f" {result['tensors']} tensors in {result['buckets']} buckets of <= {args.bucket_mb:g} MiB"
    )
    if not all(result["exact"]):
        raise SystemExit(f"the engine's weights differ from the bridge's export after a sync: {result['exact']}")
    if args.device != "cpu" and result["freed"] < result["adopted"]:
        raise SystemExit(
            f"the engine's sleep gave back {result['freed']} bytes of device memory, fewer than the {result['adopted']}"
            " of its parameters that live in the sync's buffers: something still holds them"
        )
    print(
        "check passed: the engine holds the bridge's export bit for bit after each sync (and after a sleep and"
        f" wake-up); {result['adopted'] / 2**20:.1f} MiB of its parameters are the sync's buffers"
        + (f"; its sleep gave back {result['freed'] / 2**20:.1f} MiB of device memory" if args.device != "cpu" else "")
    )
    taken = f"{result['sums_from_pack']} of {result['buckets']} buckets"
    print(f"{taken} came with the pack's checksums (equal to a read-back)")
    print_rows(best, nbytes, 26)


if __name__ == "__main__":
    main()
