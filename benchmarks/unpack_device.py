"""Benchmark + check: the rollout rank's unpack of TP-sharded buckets (rollout TP > 1) on one device, vs a copy.

    python benchmarks/unpack_device.py                       # CUDA: a Qwen2-1.5B-sized Llama (8 KV heads), bf16
    python benchmarks/unpack_device.py --device cpu --quick  # the same code on CPU, seconds

With a TP > 1 actor every rollout rank gathers each sharded bucket's TP rows (NCCL) and unpacks them into the
flat bucket of HF tensors (`pack.unpack_bucket`: each mapping's own rule, `Mapping.unshard_to_hf`, a copy per
shard and HF tensor: QKV split per query group, gate/up per shard, the vocabulary without its padding rows). One
GPU cannot run the NCCL ranks, but the unpack is one process's work: here every TP rank's shards are made from
random HF tensors (`Mapping.to_mcore` + `shard`, as the bridge lays them out), packed (`pack.pack_bucket`) and
stacked, then each sharded bucket is unpacked. On a GPU the pack is one launch a bucket (`pack_bucket_summed`), and
so is the unpack (`unpack_runs.unpack_in_one_launch`: the rules' permutation, traced once per bucket layout, as
runs of words copied and summed per HF tensor); by its rules it is one copy per shard and tensor (H200,
2026-12-04: 280 / 560 / 1,120 copies at TP 2 / 4 / 8, 0.19x / 0.12x / 0.05x of a device copy).

Checked before timing: every unpacked bucket holds the HF tensors bit for bit, by the rules and by the default
path (one launch on a GPU), whose checksums equal `protocol.checksums`. Timed (best of --repeats, alternating, the
device synchronized at both ends): `copy` (one copy of all the sharded buckets' bytes), `unpack by rules` and
`unpack` (every sharded bucket unpacked into its flat buffer: the default path), per TP size. Prints GB/s, the
ratio against the copy, the number of copy calls the rules make (`Tensor.copy_` counted once, untimed) and how
many buckets went in one launch.
"""

from __future__ import annotations

import argparse
import itertools
from unittest import mock

import torch
from ipc_device import print_rows, timed  # the sibling benchmark's timer (the device synchronized) and rows

from megarl.models.hf_config import describe_hf_config
from megarl.models.mapping import padded_vocab_size
from megarl.models.weight_map import WeightMap
from megarl.rollout.sharding.pack import pack_bucket, unpack_bucket
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, ParamMeta, plan_sync
from megarl.rollout.sharding.protocol import checksums


def model_config(quick: bool):
    from megarl.testing.models import tiny_hf_config

    size = (
        dict(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=8, intermediate_size=704)
        if quick
        else dict(
            vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=8960
        )
    )
    return tiny_hf_config("llama", **size)


def tp_layout(config, tp: int, device: str, dtype: torch.dtype):
    """(weight map, per-parameter metadata, per-rank shards {name: tensor}, HF tensors) of one stage at TP `tp`."""
    from transformers import AutoModelForCausalLM

    dims = describe_hf_config(config)
    wmap = WeightMap(dims)
    padded = padded_vocab_size(dims.vocab_size, tp)
    with torch.device("meta"):  # the HF tensors' shapes, no memory
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(tp)
    hf, metas, ranks = {}, [], [{} for _ in range(tp)]
    for mapping in wmap.all_mappings():
        for name in mapping.hf:
            hf[name] = torch.randn(shapes[name], generator=generator, device=device).to(dtype)
        full = mapping.to_mcore([hf[name] for name in mapping.hf], dims, padded)
        for rank in range(tp):
            ranks[rank][(0, mapping.mcore)] = mapping.shard(full, rank, tp).contiguous()
        metas.append(ParamMeta(mapping.mcore, tuple(ranks[0][(0, mapping.mcore)].shape), str(dtype)[6:], 0, 0, 0))
    return wmap, metas, ranks, hf


def run_tp(config, tp: int, device: str, dtype: torch.dtype, bucket_mb: float, repeats: int) -> dict:
    wmap, metas, ranks, hf = tp_layout(config, tp, device, dtype)
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=1, bucket_bytes=int(bucket_mb * 2**20))
    sharded = [b for b in plan.buckets if b.sharded and not b.arrives_flat]
    gathered = {b.index: torch.cat([pack_bucket(b, rank, wmap.dims) for rank in ranks]) for b in sharded}
    outs = {b.index: torch.empty(b.hf_numel, dtype=dtype, device=device) for b in sharded}
    launched = 0
    for bucket, batched in itertools.product(sharded, (False, None)):  # the check: the HF tensors, bit for bit
        outs[bucket.index].fill_(float("nan"))
        flat = unpack_bucket(bucket, gathered[bucket.index], wmap.dims, outs[bucket.index], batched=batched)
        for name, tensor in flat.tensors():
            if not torch.equal(tensor, hf[name]):
                raise SystemExit(f"TP {tp}: the unpacked {name} differs from the HF tensor (batched={batched})")
        if flat.sums is not None:
            if not torch.equal(flat.sums, checksums(flat)):
                raise SystemExit(f"TP {tp}: the one-launch unpack's checksums of bucket {bucket.index} differ")
            launched += 1

    def unpack(batched=None):
        for bucket in sharded:
            unpack_bucket(bucket, gathered[bucket.index], wmap.dims, outs[bucket.index], batched=batched)

    nbytes = sum(b.hf_numel for b in sharded) * torch.empty((), dtype=dtype).element_size()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copies = _count_copies(lambda: unpack(False))
    paths = {"copy": lambda: dst.copy_(src), "unpack by rules": lambda: unpack(False), "unpack": unpack}
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            best[name] = min(best[name], timed(device, fn))
    return dict(best=best, bytes=nbytes, buckets=len(sharded), copies=copies, launched=launched)


def _count_copies(fn) -> int:
    real, calls = torch.Tensor.copy_, [0]

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "copy_", counting):
        fn()
    return calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a ~3M-parameter model")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here; pass --device cpu")
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    config = model_config(args.quick)
    for tp in args.tp:
        result = run_tp(config, tp, args.device, dtype, args.bucket_mb, args.repeats)
        best, nbytes = result["best"], result["bytes"]
        print(
            f"TP {tp}: {nbytes / 2**20:.1f} MiB in {result['buckets']} sharded buckets, unpacked bit for bit;"
            f" {result['copies']} copy_ calls an unpack by rules; {result['launched']} buckets in one launch each"
        )
        print_rows(best, nbytes, 15, indent="  ")


if __name__ == "__main__":
    main()
