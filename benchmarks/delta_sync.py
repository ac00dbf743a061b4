"""Benchmark: delta weight sync (rollout.delta_weights) against a full sync on the broadcast path.

    python benchmarks/delta_sync.py               # ~100M-parameter bf16 Llama
    python benchmarks/delta_sync.py --quick       # ~5M parameters, seconds

A bf16 Llama checkpoint is written for the run; an embedded (`transformers`) engine in another
process takes every update as an engine server on another host does (`BroadcastReceiver` over a gloo
weight group, `BroadcastSender(shm=False)`: on one host the buckets would cross by shared memory, whole;
integrity check on). Per learning rate, one real AdamW step (fp32 master weights, the LM loss on
random tokens, the result cast to bf16: what the trainer would send next) gives the next version;
then, alternating, best of --repeats: the update from the previous version sent whole (delta off)
and as a delta (only the elements whose bits changed: int32 index + bf16 value per element; a
bucket goes whole when that is not smaller). Prints the share of elements that changed, the bytes
each way sends and the seconds, and the ratios. The receiver checks every bucket it rebuilt
against the sender's checksums, so a delta that rebuilt anything else would fail the run.
On one machine gloo's loopback TCP moved ~0.85 GB/s (2026-12-02: a full 190 MiB sync in ~225 ms), about a
10 GbE link; a delta's own work is CPU (comparing the bucket with the receivers' copy, indexing and applying the
changes, on one thread here; device kernels on a GPU), so on a CPU the time ratio can exceed 1 while the bytes
ratio, what a delta saves on a slow link, is far below it.
"""

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import torch
from weight_sync import model_config  # the same two model sizes (this script runs from benchmarks/)


def receiver(hf_dir: str, port: int) -> None:
    """The engine-server side: an embedded bf16 engine taking every update until the sender closes."""
    torch.set_num_threads(1)
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, WeightGroup

    engine = EmbeddedEngine(hf_dir, dtype=torch.bfloat16)
    group = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=600)
    weights = BroadcastReceiver(group, engine)
    while weights.receive_update() is not None:
        pass


def optimizer_step(model, lr: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """One AdamW step of the fp32 model on the LM loss of random tokens; its weights in bf16."""
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (4, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [(n, t.detach().to(torch.bfloat16).clone()) for n, t in model.state_dict().items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model (~5M parameters)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup
    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import bucket_tensors
    from megarl.utils.distributed import free_port

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="megarl-delta-sync-") as hf_dir:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(args.quick), dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(hf_dir)
        model.float()
        port = free_port()
        engine_side = mp.get_context("spawn").Process(target=receiver, args=(hf_dir, port))
        engine_side.start()
        # the wire path (engine servers on other hosts): on one host the buckets would cross by shared memory
        sender = BroadcastSender(WeightGroup("127.0.0.1", port, 0, 2, timeout_s=600), shm=False)
        version = [0]

        def sync(weights, delta: bool) -> tuple[float, int]:
            sender.delta, version[0] = delta, version[0] + 1
            start = time.perf_counter()
            sender.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights])
            sender.send(bucket_tensors(weights), version[0])
            return time.perf_counter() - start, sender.sent_bytes

        try:
            current = [(n, t.detach().to(torch.bfloat16).clone()) for n, t in model.state_dict().items()]
            total = sum(t.numel() for _, t in current)
            print(f"model: {total / 1e6:.1f}M parameters, {total * 2 / 2**20:.0f} MiB in bf16")
            for seed, lr in enumerate(args.lrs):
                after = optimizer_step(model, lr, seed)
                changed = sum(
                    int((a.view(torch.int16) != b.view(torch.int16)).sum()) for (_, a), (_, b) in zip(current, after)
                )
                full, delta = [], []
                for _ in range(args.repeats):  # each from the previous version, alternating
                    sync(current, delta=True)
                    delta.append(sync(after, delta=True))
                    sync(current, delta=False)
                    full.append(sync(after, delta=False))
                (t_full, b_full), (t_delta, b_delta) = min(full), min(delta)
                print(
                    f"lr {lr:g}: {changed / total:.2%} of the bf16 elements changed;"
                    f" full {b_full / 2**20:.1f} MiB {t_full * 1e3:.0f} ms,"
                    f" delta {b_delta / 2**20:.1f} MiB {t_delta * 1e3:.0f} ms;"
                    f" bytes ratio delta/full {b_delta / b_full:.3f}, time ratio {t_delta / t_full:.2f}"
                )
                current = after
        finally:
            sender.close()
            engine_side.join(timeout=60)
            if engine_side.is_alive():
                engine_side.kill()


if __name__ == "__main__":
    main()
