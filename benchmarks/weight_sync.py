"""Benchmark: sharding-manager weight sync (reshard + transfer) against a plain copy of the same bytes.

    python benchmarks/weight_sync.py            # ~100M-parameter Llama, TP2×PP2 → one rollout rank (TP1)
    python benchmarks/weight_sync.py --quick    # ~7M parameters, seconds
    python benchmarks/weight_sync.py --bucket-mb 16 --repeats 5

Four gloo ranks on CPU hold a randomly initialised megatron-core Llama at TP2×PP2; rank 0 is the
rollout rank. Measured on rank 0, in the same run, alternating, best of --repeats:
  * sync      — `ShardingManager.iter_weights()` fully consumed: per bucket one TP all-gather,
                the PP stage-1 leader's send to rank 0, unshard + to_hf (QKV per group, gate/up,
                vocab padding dropped) into HF tensors;
  * per-param — the same manager and pipeline with one parameter per bucket;
  * naive     — the per-tensor loop most exporters run: each stage walks its parameters with a
                blocking TP all-gather per parameter (`ModelBridge.iter_hf_weights`), and the
                stage-1 leader sends each HF tensor to rank 0 with a blocking send (names and
                shapes exchanged once up front — more generous than per-tensor name broadcasts);
  * copy      — `dst.copy_(src)` of the same number of bytes in one process (the memory floor);
  * send      — one gloo send of the same bytes from rank 2 (stage 1) to rank 0 (the wire floor).
Prints GB/s of each and the ratios sync/copy and sync/per-param. The model is never written to
disk; weights are what megatron initialises. Also checks (once, before timing) that the synced
tensors equal the bridge's reference export bit for bit.
"""
import argparse
import os
import time

import torch

from megarl.models.layout import ParallelLayout


def model_config(quick: bool):
    from megarl.testing.models import tiny_hf_config

    if quick:
        return tiny_hf_config("llama", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                              intermediate_size=704)
    return tiny_hf_config("llama", vocab_size=32000, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4,
                          intermediate_size=2048)


def timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def bench_rank(quick: bool, bucket_mb: float, repeats: int):
    import torch.distributed as dist

    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron, ranks
    from megarl.rollout.sharding.manager import ShardingManager

    layout = ParallelLayout(tp=2, pp=2)
    init_megatron(layout)
    tp_rank, pp_rank, _ = ranks()
    rank = dist.get_rank()
    bridge = ModelBridge(model_config(quick), layout)
    chunks = bridge.build(pp_rank)
    fast = ShardingManager(bridge, chunks, bucket_bytes=int(bucket_mb * 2**20))
    per_param = ShardingManager(bridge, chunks, bucket_bytes=1)
    total = fast.plan.total_bytes
    hf_bytes = sum(torch.Size(s.shape).numel() * 4 for s in fast.hf_specs())

    def consume(manager):
        def run():
            for _name, tensor in manager.iter_weights():
                pass  # an engine would copy `tensor` into its parameter here
        return run

    numel = total // 4
    rss_before = _max_rss_mb()
    consume(fast)()  # first sync: how far does rank 0's peak memory grow?
    rss_growth = _max_rss_mb() - rss_before
    check = _check_against_reference(fast, bridge, chunks, pp_rank)

    src = torch.randn(numel) if rank == 0 else None
    dst = torch.empty(numel) if rank == 0 else None
    wire = torch.randn(numel) if rank in (0, 2) else None

    def copy():
        if rank == 0:
            dst.copy_(src)

    def send():
        if rank == 2:
            dist.send(wire, dst=0)
        elif rank == 0:
            dist.recv(wire, src=2)

    naive = _naive_exporter(bridge, chunks, pp_rank, tp_rank, rank)
    times = {k: [] for k in ("sync", "per-param", "naive", "copy", "send")}
    for _ in range(repeats):  # alternate, so machine load hits all alike
        times["sync"].append(timed(consume(fast)))
        times["per-param"].append(timed(consume(per_param)))
        times["naive"].append(timed(naive))
        times["copy"].append(timed(copy))
        times["send"].append(timed(send))
    if rank != 0:
        return None
    return dict(times={k: min(v) for k, v in times.items()}, total=total, hf_bytes=hf_bytes,
                buckets=len(fast.plan.buckets), per_param_buckets=len(per_param.plan.buckets),
                largest_bucket=max(b.nbytes for b in fast.plan.buckets), check=check,
                params=sum(torch.Size(s.shape).numel() for s in fast.hf_specs()),
                exchanges=fast.metadata_exchanges, rss_growth=rss_growth)


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _naive_exporter(bridge, chunks, pp_rank, tp_rank, rank):
    """A per-tensor export loop (blocking per-parameter TP gather, per-tensor send to rank 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    # stage 1's HF names and shapes, once (the same order as its iter_hf_weights)
    names = [(n, tuple(t.shape)) for n, t in bridge.iter_hf_weights(chunks, pp_rank=pp_rank, tp_group=tp_group)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pp_rank, tp_rank, names))
    remote = next(n for p, t, n in everyone if p == 1 and t == 0)
    leader_of_stage1 = next(i for i, (p, t, _) in enumerate(everyone) if p == 1 and t == 0)

    def run():
        for _name, tensor in bridge.iter_hf_weights(chunks, pp_rank=pp_rank, tp_group=tp_group):
            if pp_rank == 1 and tp_rank == 0:
                dist.send(tensor.contiguous(), dst=0)
        if rank == 0:
            for _name, shape in remote:
                dist.recv(torch.empty(shape), src=leader_of_stage1)
    return run


def _check_against_reference(manager, bridge, chunks, pp_rank):
    """Synced tensors == the bridge's per-parameter export (all ranks take part; True on rank 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    synced = {name: t.clone() for name, t in manager.iter_weights()}
    mine = dict(bridge.iter_hf_weights(chunks, pp_rank=pp_rank, tp_group=ps.get_tensor_model_parallel_group()))
    mine = {k: v for k, v in mine.items()} if ps.get_tensor_model_parallel_rank() == 0 else {}
    everyone = [None] * dist.get_world_size()
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    reference = {k: v for d in everyone for k, v in d.items()}
    return reference.keys() == synced.keys() and all(torch.equal(synced[k], reference[k]) for k in reference)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model (~7M parameters)")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size bound in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    from megarl.utils.distributed import run_distributed

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    result = run_distributed(bench_rank, 4, args.quick, args.bucket_mb, args.repeats, num_threads=args.threads,
                             timeout=1800)[0]
    gb = result["total"] / 1e9
    print(f"model: {result['params'] / 1e6:.1f}M parameters; {gb:.3f} GB gathered at TP2×PP2 → {result['hf_bytes'] / 1e9:.3f}"
          f" GB of HF tensors (fp32) on the rollout rank")
    print(f"plan: {result['buckets']} buckets of ≤ {args.bucket_mb:g} MiB (largest {result['largest_bucket'] / 2**20:.1f}"
          f" MiB); per-param plan: {result['per_param_buckets']} buckets; metadata exchanges: {result['exchanges']}")
    print(f"synced tensors equal the bridge's reference export: {result['check']}")
    print(f"rank 0 peak RSS growth during the first sync: {result['rss_growth']:.0f} MiB (bucket bound"
          f" {args.bucket_mb:g} MiB, largest bucket {result['largest_bucket'] / 2**20:.0f} MiB; model"
          f" {result['hf_bytes'] / 2**20:.0f} MiB)")
    for name, seconds in result["times"].items():
        print(f"  {name:10s} {seconds * 1e3:9.1f} ms   {gb / seconds:7.2f} GB/s")
    t = result["times"]
    print(f"ratio sync/copy (bytes/s): {t['copy'] / t['sync']:.3f}   sync/send: {t['send'] / t['sync']:.3f}"
          f"   speedup over naive: {t['naive'] / t['sync']:.2f}x   over per-param: {t['per-param'] / t['sync']:.2f}x")


if __name__ == "__main__":
    main()
