"""Context parallelism (CP): which sequence columns a CP rank holds, and the way back to full rows.

Owns: `CPShard` (a micro-batch's CP group, size and rank), `cp_columns` / `split_for_cp` (the
load-balanced split) and `gather_from_cp` (all-gather + un-permute, differentiable).

The split is megatron-core's per-sequence "zigzag" (`utils._get_batch_on_this_cp_rank_per_sequence_
balancing`, 0.19.2): a width-S frame (S a multiple of 2·cp) is cut into 2·cp equal chunks and CP
rank r keeps chunks r and 2·cp−1−r, in that order, so every rank gets the same share of causal
attention work. GPTModel expects exactly this layout for BSHD inputs: its RoPE table is built for
S = local length × cp and sliced with the same zigzag (`rope_utils.get_pos_emb_on_this_cp_rank`),
and Transformer Engine's CP attention (p2p ring, causal mask) assumes each rank's two halves are
those chunks. Right padding is harmless: under the causal mask padding only ever feeds padding.

Backward of `gather_from_cp`: every CP rank computes the *same* loss from the gathered [b, S]
outputs (same rows, same gathered values), so the gradient reaching rank r's local outputs is just
its own columns of dLoss/d(full) — no communication (megatron's
`gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)` does the same). The
gradient each CP rank then back-propagates covers only its own tokens; TE's attention backward
returns the K/V gradients to the ranks that own them, so the CP ranks' weight gradients sum to the
cp=1 gradient (the engine's loss scaling is derived in `engine._micro_loss`).

Imports only torch (any torch.distributed group works, gloo included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPShard:
    """This rank's place in its role's CP group (attached to every micro-batch when cp > 1)."""

    group: object
    """The CP process group (ranks holding the other chunks of the same rows)."""
    size: int
    rank: int


def cp_columns(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Columns of a width-`seq_len` frame that CP rank `cp_rank` holds, in its local order."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence width {seq_len} is not a multiple of 2*cp = {2 * cp_size}; pad micro-batches"
            " to it (make_micro_batches(width_multiple=...))"
        )
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's columns of `x` along `dim` ([b, S, ...] → [b, S/cp, ...]); identity at cp = 1."""
    if cp_size == 1:
        return x
    return x.index_select(dim, cp_columns(x.shape[dim], cp_size, cp_rank).to(x.device))


def unpermute_from_cp(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp` over all ranks: rank-ordered local parts → the full frame."""
    cp_size = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    order = torch.cat([cp_columns(seq_len, cp_size, r) for r in range(cp_size)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order).to(parts[0].device))


class _GatherFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, shard, dim):
        ctx.shard, ctx.dim = shard, dim
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(shard.size)]
        dist.all_gather(parts, local, group=shard.group)
        return unpermute_from_cp(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # Same loss on every CP rank (see the module docstring): keep this rank's columns only.
        return split_for_cp(grad, ctx.shard.size, ctx.shard.rank, ctx.dim), None, None


def gather_from_cp(local: torch.Tensor, shard: CPShard | None, dim: int = 1) -> torch.Tensor:
    """Full frame [b, S, ...] from every CP rank's [b, S/cp, ...] (differentiable); identity without CP."""
    if shard is None or shard.size == 1:
        return local
    return _GatherFromCP.apply(local, shard, dim)
