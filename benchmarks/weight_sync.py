"""Benchmark: sharding-manager weight sync into rollout engines, per path, against a plain copy.

    python benchmarks/weight_sync.py            # ~100M-parameter Llama, TP2×PP2 → one rollout rank (TP1)
    python benchmarks/weight_sync.py --quick    # ~5M parameters, seconds (plus vLLM's start-up)
    python benchmarks/weight_sync.py --bucket-mb 16 --repeats 6 --no-vllm

Buckets are bounded by the sharding manager's default (`plan.DEFAULT_BUCKET_BYTES`, 256 MiB: what a training run's
syncs use) unless --bucket-mb says otherwise; until 2026-11-27 this benchmark's default was 16 MiB, which makes 22
buckets of the 100M model instead of 4 (more round trips per sync: IPC 0.37–0.49× of a copy against 0.51–0.71× at
256 MiB in the same hour), and benchmarks/HISTORY.md's earlier rows were measured with it.

Four gloo ranks on CPU hold a megatron-core Llama at TP2×PP2, loaded from a random HF checkpoint
written for the run; rank 0 is the rollout rank. Measured in the same run, alternating, best of
--repeats (times on rank 0, every rank between two barriers; a verified path and its unverified twin swap
places every other round, since the first sync of a transport after another's runs slower):
  * gather     — `ShardingManager.iter_weights()` fully consumed, no engine: per bucket each TP rank
                 writes its shards straight into rank 0's shared-memory buffer (all ranks are CPU
                 processes on this host: `rollout.sharding.shm`), already as HF tensors (QKV split
                 per group, gate/up, vocab padding dropped: `Mapping.shard_to_hf`);
  * gather-gloo, in-process-gloo — the same over gloo messages, one per TP rank and bucket
                 (`ShardingManager(host_shm=False)`, the transport of ranks on several hosts);
  * in-process — `ShardingManager.sync(InPlaceSender(engine, adopt=True))` into an embedded (`transformers`)
                 engine in rank 0: a sync lands in the engine's own buffers, which it took as its
                 parameters at its first sync (`EmbeddedEngine.load_buckets`): it writes the model;
  * ipc        — `sync(IpcSender(engine, adopt=True))` (one sender, as the rollout worker keeps it) into a
                 vLLM CPU engine (AsyncLLM: its engine core is a child process of rank 0): each bucket lands
                 in shared memory the sender keeps for this engine and crosses by handle; the worker replays
                 its loaders' copies, and from the third sync on its parameters are views of those buffers
                 (`load_plan.ReplayingLoader.adopt`): the ranks write the model, the worker only checks it
                 (skipped with --no-vllm or without vLLM; `MEGARL_ADOPT_WEIGHTS=0`: the worker copies every
                 update in, the path before 2026-11-27);
  * broadcast  — `sync(BroadcastSender(group))` to an embedded engine in another process over a
                 gloo weight group (the server-mode path). Both processes run on this host, so the
                 buckets cross by shared memory (since 2026-11-27): the ranks write each bucket into
                 shared memory the sender keeps per bucket position, which the receiver's engine took as
                 its parameters at its first sync (adoption, since 2026-12-03: it then only checks them;
                 before, it copied each bucket from the sender's buffer into its model, checking as it
                 copied: `MEGARL_ADOPT_WEIGHTS=0`); only control messages, places and checksums go over
                 the group;
  * broadcast-tcp — the same with `BroadcastSender(shm=False)`: one gloo broadcast per bucket buffer
                 (the path of engine servers on other hosts, on CPU);
  * ipc-unverified, broadcast-unverified — the same without the integrity check (`verify=False`:
                 no per-tensor checksums taken by the sender and checked by the receiver); the
                 report prints the check's share of each path's sync time (best of each twin, and the
                 mean over the rounds of each round's pair);
  * per-param  — `gather` with one parameter per bucket;
  * naive      — the per-tensor loop most exporters run: a blocking TP all-gather per parameter
                 (`ModelBridge.iter_hf_weights`) and a blocking send per HF tensor to rank 0;
  * copy       — `dst.copy_(src)` of the HF bytes in one process (the memory floor);
  * send       — one gloo send of the gathered bytes from rank 2 (stage 1) to rank 0 (the wire floor).
Prints GB/s (HF bytes / time) and, for every path, its ratio against `copy` (bytes/s, higher is
better; 1.0 would be a sync as fast as copying the weights once in memory) and how many of the host's
cores were busy meanwhile (CPU seconds of every process / seconds over all its runs, from /proc/stat:
printed for paths whose runs add up to 0.5 s or more, its ticks are 10 ms): near the core count a
path is CPU-bound, well below it it waits on round trips. Checks once, before
timing, that the gathered tensors equal the bridge's reference export and that the engines hold
the checkpoint's tensors bit for bit after a sync.
"""

import argparse
import os
import tempfile
import time
from typing import Optional

import torch

from megarl.models.layout import ParallelLayout
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES

LAYOUT = ParallelLayout(tp=2, pp=2)


def model_config(quick: bool):
    from megarl.testing.models import tiny_hf_config

    if quick:
        return tiny_hf_config(
            "llama", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704
        )
    return tiny_hf_config(
        "llama", vocab_size=32000, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048
    )


def write_checkpoint(quick: bool, path: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(quick), dtype=torch.float32).save_pretrained(path)


def timed(fn) -> tuple[float, float]:
    """(seconds, CPU seconds this host's cores were busy meanwhile, every process counted) of one run."""
    import torch.distributed as dist

    dist.barrier()
    busy, start = busy_seconds(), time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start, busy_seconds() - busy


def _cores_busy(runs: list[tuple[float, float]]) -> Optional[float]:
    """Cores busy over all runs of a path; None below 0.5 s in all (/proc/stat counts in 10 ms ticks)."""
    seconds = sum(s for s, _ in runs)
    return sum(b for _, b in runs) / seconds if seconds >= 0.5 else None


def busy_seconds() -> float:
    """CPU seconds all cores of this host have been busy since boot (Linux /proc/stat; 0 elsewhere): what a
    path costs in CPU, and whether it left cores idle (a sync waiting on round trips) or none (CPU-bound)."""
    try:
        with open("/proc/stat") as stat:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, stat.readline().split()[1:8])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


# -- the three sync paths (rank 0 holds the engine or sender; the other ranks pass None) -----------
_VERSION = [0]


def _sync(manager, sender):
    _VERSION[0] += 1
    return manager.sync(sender, version=_VERSION[0])


def sync_in_process(manager, engine):
    from megarl.rollout.sharding.senders import InPlaceSender

    return _sync(manager, engine and InPlaceSender(engine, adopt=True))


def sync_ipc(manager, sender, verify: bool = True):
    if sender is not None:
        sender.verify = verify
    return _sync(manager, sender)


def sync_broadcast(manager, sender, verify: bool = True, shm: bool = True):
    if sender is not None:  # the receiver follows what each update's header and first message say
        sender.verify, sender.shm = verify, shm
    return _sync(manager, sender)


def make_engines(hf_dir: str, port: int, use_vllm: bool, bucket_bytes: int):
    """Rank 0: {path: engine or sender} (the vLLM engine core starts in a child process here)."""
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup

    engines = {
        "in-process": EmbeddedEngine(hf_dir),
        "broadcast": BroadcastSender(WeightGroup("127.0.0.1", port, 0, 2, timeout_s=600)),
    }
    if use_vllm:
        from megarl.rollout.sharding.ipc import IpcSender
        from megarl.rollout.vllm_engine import VLLMEngine

        engines["ipc"] = VLLMEngine(hf_dir, update_bucket_bytes=bucket_bytes)
        engines["ipc-sender"] = IpcSender(engines["ipc"], adopt=True)
    return engines


def broadcast_receiver(hf_dir: str, port: int, threads: int) -> None:
    """The engine-server side of the broadcast path: an embedded engine taking every update."""
    torch.set_num_threads(threads)
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, WeightGroup

    receiver = BroadcastReceiver(WeightGroup("127.0.0.1", port, 1, 2, timeout_s=600), EmbeddedEngine(hf_dir))
    while receiver.receive_update() is not None:
        pass


def bench_rank(quick: bool, bucket_mb: float, repeats: int, hf_dir: str, port: int, use_vllm: bool):
    import torch.distributed as dist

    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron, ranks
    from megarl.rollout.sharding.manager import ShardingManager

    init_megatron(LAYOUT)
    tp_rank, pp_rank, _ = ranks()
    rank = dist.get_rank()
    bridge = ModelBridge.from_hf_path(hf_dir, LAYOUT)
    chunks = bridge.build(pp_rank)
    bridge.load_hf_weights(chunks, hf_dir, tp_rank=tp_rank, pp_rank=pp_rank)
    fast = ShardingManager(bridge, chunks, bucket_bytes=int(bucket_mb * 2**20))
    per_param = ShardingManager(bridge, chunks, bucket_bytes=1)
    gloo = ShardingManager(bridge, chunks, bucket_bytes=int(bucket_mb * 2**20), host_shm=False)
    total = fast.plan.total_bytes
    hf_bytes = sum(torch.Size(s.shape).numel() * 4 for s in fast.hf_specs())

    rss_before = _max_rss_mb()
    _consume(fast)()  # first sync: how far does rank 0's peak memory grow?
    rss_growth = _max_rss_mb() - rss_before
    checks = [_check_against_reference(m, bridge, chunks, pp_rank) for m in (fast, gloo)]  # every rank runs both
    check = all(checks)
    engines = make_engines(hf_dir, port, use_vllm, fast.bucket_bytes) if rank == 0 else {}
    paths = {
        "gather": _consume(fast),
        "gather-gloo": _consume(gloo),
        "in-process": lambda: sync_in_process(fast, engines.get("in-process")),
        "in-process-gloo": lambda: sync_in_process(gloo, engines.get("in-process")),
        "broadcast": lambda: sync_broadcast(fast, engines.get("broadcast")),
        "broadcast-unverified": lambda: sync_broadcast(fast, engines.get("broadcast"), verify=False),
        "broadcast-tcp": lambda: sync_broadcast(fast, engines.get("broadcast"), shm=False),
    }
    if use_vllm:
        paths["ipc"] = lambda: sync_ipc(fast, engines.get("ipc-sender"))
        paths["ipc-unverified"] = lambda: sync_ipc(fast, engines.get("ipc-sender"), verify=False)
    paths.update({"per-param": _consume(per_param), "naive": _naive_exporter(bridge, chunks, pp_rank, tp_rank, rank)})
    paths.update(_baselines(rank, total, hf_bytes))
    engines_exact = _engines_hold_checkpoint(paths, engines, hf_dir)
    times = {name: [] for name in paths}
    for repeat in range(repeats):  # alternate, so machine load hits all alike
        for name in _order(list(paths), repeat):
            times[name].append(timed(paths[name]))
    if rank != 0:
        return None
    engines["broadcast"].close()
    adopted_ipc_mb = _adopted_mb(engines.get("ipc"))
    if "ipc" in engines:
        engines["ipc"].shutdown()
    return dict(
        times={k: min(v)[0] for k, v in times.items()},
        shares={  # per round, the check's share of the verified sync against its twin run next to it
            k: [1 - u[0] / v[0] for v, u in zip(times[k], times[k + "-unverified"])]
            for k in ("ipc", "broadcast")
            if k in times
        },
        cores={k: _cores_busy(v) for k, v in times.items()},
        total=total,
        hf_bytes=hf_bytes,
        buckets=len(fast.plan.buckets),
        per_param_buckets=len(per_param.plan.buckets),
        largest_bucket=max(b.nbytes for b in fast.plan.buckets),
        check=check,
        engines_exact=engines_exact,
        params=sum(torch.Size(s.shape).numel() for s in fast.hf_specs()),
        exchanges=fast.metadata_exchanges,
        rss_growth=rss_growth,
        kept_mb=(getattr(engines.get("ipc-sender"), "buffers", None) or fast.kept).nbytes / 2**20,
        adopted_ipc_mb=adopted_ipc_mb,
        adopted_mb=engines["in-process"].update_buffers.nbytes / 2**20,
    )


def _adopted_mb(engine) -> float:
    """MiB of the vLLM engine's parameters that live in its IPC sender's buffers (0 without vLLM)."""
    return 0.0 if engine is None else sum(engine.run_sync(engine.llm.collective_rpc("megarl_adopted_bytes"))) / 2**20


def _order(names: list[str], repeat: int) -> list[str]:
    """The paths' order in one round: each verified path and its unverified twin swap places every other round.
    The first sync of a transport after another transport's runs slower (~90 ms of 250 in an IPC sync, measured
    2026-11-27 by running the twins the other way round); in a fixed order the first twin paid it every time,
    and the check's share was that difference."""
    order = list(names)
    if repeat % 2:
        for name in names:
            twin = name + "-unverified"
            if twin in order:
                i, j = order.index(name), order.index(twin)
                order[i], order[j] = twin, name
    return order


def _consume(manager):
    def run():
        for _name, _tensor in manager.iter_weights():
            pass  # an engine would copy `tensor` into its parameter here

    return run


def _baselines(rank: int, total: int, hf_bytes: int) -> dict:
    import torch.distributed as dist

    src = torch.randn(hf_bytes // 4) if rank == 0 else None
    dst = torch.empty(hf_bytes // 4) if rank == 0 else None
    wire = torch.randn(total // 4) if rank in (0, 2) else None

    def copy():
        if rank == 0:
            dst.copy_(src)

    def send():
        if rank == 2:
            dist.send(wire, dst=0)
        elif rank == 0:
            dist.recv(wire, src=2)

    return {"copy": copy, "send": send}


def _engines_hold_checkpoint(paths, engines, hf_dir) -> dict:
    """One sync per engine path; then the embedded engine's tensors against the checkpoint (rank 0)."""
    from safetensors.torch import load_file

    for name in ("in-process", "broadcast", "ipc"):
        if name in paths:
            paths[name]()
    if not engines:
        return {}
    checkpoint = load_file(os.path.join(hf_dir, "model.safetensors"))
    params = engines["in-process"]._params
    return {
        "in-process": params.keys() == checkpoint.keys()
        and all(torch.equal(params[n], t) for n, t in checkpoint.items())
    }


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


def report(result, bucket_mb: float) -> None:
    gb = result["hf_bytes"] / 1e9
    print(
        f"model: {result['params'] / 1e6:.1f}M parameters; {result['total'] / 1e9:.3f} GB gathered at TP2×PP2 →"
        f" {gb:.3f} GB of HF tensors (fp32) on the rollout rank"
    )
    print(
        f"plan: {result['buckets']} buckets of ≤ {bucket_mb:g} MiB (largest {result['largest_bucket'] / 2**20:.1f}"
        f" MiB); per-param plan: {result['per_param_buckets']} buckets; metadata exchanges: {result['exchanges']}"
    )
    print(
        f"gathered tensors equal the bridge's reference export: {result['check']};"
        f" engines hold the checkpoint bit for bit: {result['engines_exact']}"
    )
    print(
        f"rank 0 peak RSS growth during the first gather: {result['rss_growth']:.0f} MiB (largest bucket"
        f" {result['largest_bucket'] / 2**20:.0f} MiB; model {result['hf_bytes'] / 2**20:.0f} MiB)"
    )
    print(
        f"shared-memory buffers kept between syncs for the ipc path: {result['kept_mb']:.0f} MiB (the vLLM"
        f" worker's parameters in them: {result['adopted_ipc_mb']:.0f} MiB); the in-process engine's sync buffers"
        f" (its parameters, both transports): {result['adopted_mb']:.0f} MiB"
    )
    t = result["times"]
    for name, seconds in t.items():
        print(
            f"  {name:20s} {seconds * 1e3:9.1f} ms   {gb / seconds:7.2f} GB/s   ratio vs copy {t['copy'] / seconds:6.3f}"
            + (f"   cores busy {cores:3.1f} of {os.cpu_count()}" if (cores := result["cores"][name]) else "")
        )
    print(
        "ratio vs copy (bytes/s): "
        + "   ".join(
            f"{name} {t['copy'] / t[name]:.3f}" for name in ("gather", "in-process", "ipc", "broadcast") if name in t
        )
    )
    print(
        "integrity check (checksums taken and checked), share of the sync time: "
        + "   ".join(
            f"{name} {1 - t[name + '-unverified'] / t[name]:+.1%}" for name in ("ipc", "broadcast") if name in t
        )
    )
    print(  # the first of a round's twins pays for the switch of transport: in an even number of rounds the mean
        # of the two orders cancels it
        "  the same, mean over the rounds (each round's twins next to each other, in turns first): "
        + "   ".join(
            f"{name} {sum(v) / len(v):+.1%} (rounds {min(v):+.1%}..{max(v):+.1%})"
            for name, v in result["shares"].items()
        )
    )
    print(
        f"same-host shared memory vs gloo messages (`ShardingManager(host_shm=False)`): gather"
        f" {t['gather-gloo'] / t['gather']:.2f}x   in-process {t['in-process-gloo'] / t['in-process']:.2f}x"
        f"   broadcast {t['broadcast-tcp'] / t['broadcast']:.2f}x (`BroadcastSender(shm=False)`: the gloo"
        f" broadcast, {t['copy'] / t['broadcast-tcp']:.3f} of a copy)"
    )
    print(
        f"gather vs send (wire floor): {t['send'] / t['gather']:.3f}   gather speedup over naive:"
        f" {t['naive'] / t['gather']:.2f}x   over per-param: {t['per-param'] / t['gather']:.2f}x"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model (~5M parameters)")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help="bucket size bound in MiB (default: the sharding manager's, what training runs use)",
    )
    parser.add_argument("--repeats", type=int, default=6, help="rounds (even: the twins run first equally often)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--no-vllm", action="store_true", help="skip the IPC path (a vLLM CPU engine)")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from megarl.rollout import vllm_available
    from megarl.utils.distributed import free_port, run_distributed

    use_vllm = not args.no_vllm and vllm_available()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; ipc path: {use_vllm}")
    with tempfile.TemporaryDirectory(prefix="megarl-weight-sync-") as hf_dir:
        write_checkpoint(args.quick, hf_dir)
        port = free_port()
        receiver = mp.get_context("spawn").Process(target=broadcast_receiver, args=(hf_dir, port, args.threads))
        receiver.start()
        try:
            result = run_distributed(
                bench_rank,
                4,
                args.quick,
                args.bucket_mb,
                args.repeats,
                hf_dir,
                port,
                use_vllm,
                num_threads=args.threads,
                timeout=3600,
            )[0]
        finally:
            receiver.join(timeout=60)
            if receiver.is_alive():
                receiver.kill()
    report(result, args.bucket_mb)


if __name__ == "__main__":
    main()
