"""Moving a planned bucket's bytes: pack shards, gather TP with one collective, ship across PP.

Owns: `pack_bucket` / `unpack_bucket` (pure: flat buffer ↔ HF tensors by the plan) and
`gather_bucket`, the in-process transport run on every rank of one model replica: the owning
stage's TP ranks all-gather the bucket's flat buffer (one collective per bucket, not per
tensor) and the stage's first TP rank sends it to each rollout rank outside the stage
(`torch.distributed.send`/`recv`; gloo on CPU, NCCL on GPU). Peak extra memory on a receiver: the
gathered bucket plus the unsharded tensors of one parameter at a time.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megarl.rollout.sharding.plan import Bucket


def pack_bucket(bucket: Bucket, local_params: dict, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This TP rank's shards of the bucket, flattened into one buffer [local_numel].

    `local_params` maps (vp_stage, chunk-local name) → the parameter tensor.
    """
    buf = out if out is not None else torch.empty(bucket.local_numel, dtype=bucket.dtype,
                                                  device=_device_of(bucket, local_params))
    for p in bucket.params:
        src = local_params[(p.meta.vp_stage, p.meta.name)].detach()
        buf[p.offset:p.offset + p.numel].view(p.meta.shape).copy_(src)
    return buf


def unpack_bucket(bucket: Bucket, gathered: torch.Tensor, dims) -> list[tuple[str, torch.Tensor]]:
    """HF tensors (views or fresh tensors) from the gathered buffer [tp * local_numel] or [local_numel]."""
    rows = gathered.view(bucket.tp_size if bucket.sharded else 1, bucket.local_numel)
    out = []
    for p in bucket.params:
        shards = [row[p.offset:p.offset + p.numel].view(p.meta.shape) for row in rows]
        full = p.mapping.unshard(shards)
        out.extend(zip(p.mapping.hf, p.mapping.to_hf(full, dims)))
    return out


def gather_bucket(bucket: Bucket, local_params: dict, *, my_rank: int, stage_ranks: Sequence[Sequence[int]],
                  tp_group, dest_ranks: Sequence[int]) -> Optional[torch.Tensor]:
    """Run this rank's part of moving one bucket; the gathered buffer on destination ranks, else None.

    `stage_ranks[pp][tp]` are global ranks; `dest_ranks` the global ranks that need the bucket.
    """
    import torch.distributed as dist

    stage = stage_ranks[bucket.pp_rank]
    leader = stage[0]
    in_stage = my_rank in stage
    gathered = None
    if in_stage:
        local = pack_bucket(bucket, local_params)
        if bucket.sharded:
            gathered = torch.empty(bucket.gathered_numel, dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(gathered, local, group=tp_group)
        else:
            gathered = local
        if my_rank == leader:
            for dest in dest_ranks:
                if dest not in stage:
                    dist.send(gathered, dst=dest)
        return gathered if my_rank in dest_ranks else None
    if my_rank in dest_ranks:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gathered = torch.empty(bucket.gathered_numel, dtype=bucket.dtype, device=device)
        dist.recv(gathered, src=leader)
        return gathered
    return None


def _device_of(bucket: Bucket, local_params: dict) -> torch.device:
    first = bucket.params[0].meta
    return local_params[(first.vp_stage, first.name)].device
