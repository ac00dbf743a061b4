"""Log-probability of the target token and entropy from TP-sharded logits, without the full vocabulary.

Owns: `vocab_parallel_logprobs` (an autograd function). Logits arrive as this rank's vocabulary
shard [..., V/tp] (megatron's `parallel_output=True`); the max and the sum of exponentials are
all-reduced over the TP group, so no rank ever holds [tokens × vocab] logits, and the float32
work runs over `chunk_tokens` rows at a time. The backward recomputes the softmax chunk by chunk
from the saved logits plus two per-token scalars (log Z and the entropy), so nothing of size
[tokens × vocab] is saved besides the logits the model produced anyway.

Vocabulary padding (megatron pads to a multiple of 128 × TP) is masked out: columns at or past
`vocab_size` get probability 0, so the values equal `log_softmax` over the real vocabulary.

Math, per token with logits x (already divided by the temperature T) and m = max_v x_v:
    log Z = m + log Σ_v e^(x_v − m),  log p(y) = x_y − log Z,  H = log Σ e^(x−m) − Σ_v p_v (x_v − m)
    (sums over x − m ≤ 0: no cancellation), and in the backward, with log p_v = x_v − log Z,
    ∂/∂x_v [g_logp · log p(y) + g_H · H] = g_logp · 1[v = y] − p_v · (g_logp + g_H · (log p_v + H))
and ∂/∂logits = (∂/∂x) / T.

Imports only torch (the TP group is any torch.distributed group, or None for TP = 1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _shard_range(shard_vocab: int, group) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    return rank * shard_vocab, (rank + 1) * shard_vocab


def _valid_columns(shard_vocab: int, start: int, vocab_size: Optional[int]) -> int:
    """How many leading columns of this shard are real vocabulary (the rest is padding)."""
    if vocab_size is None:
        return shard_vocab
    return max(0, min(shard_vocab, vocab_size - start))


def _scaled(chunk: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    """float32 copy of the real-vocabulary columns of a chunk of logits, divided by the temperature."""
    x = chunk[:, :valid].float()
    if x.data_ptr() == chunk.data_ptr():
        x = x.clone()
    return x.div_(temperature) if temperature != 1.0 else x


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[i, v]·b[i, v] per row without an [rows × vocab] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_forward(x: torch.Tensor, target: torch.Tensor, start: int, group):
    """(log p(target), log Z, entropy) of one chunk; x [c, valid] float32 logits of this shard (overwritten).

    Sums run over x − max (all ≤ 0), so the entropy Σ p·(x − max) has no cancellation.
    """
    target_logit = _target_logit(x, target, start)
    local_max = x.max(dim=-1).values if x.shape[1] else x.new_full((x.shape[0],), float("-inf"))
    global_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
    centred = x.sub_(global_max.unsqueeze(-1))
    exp = centred.exp()
    sums = torch.stack([exp.sum(-1), _row_dot(exp, centred), target_logit])
    sum_exp, sum_exp_centred, target_logit = _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_z = global_max + sum_exp.log()
    entropy = sum_exp.log() - sum_exp_centred / sum_exp
    return target_logit - log_z, log_z, entropy


def _target_logit(x: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
    """x[target] on the rank whose shard holds it, 0 elsewhere (summed over TP afterwards)."""
    local = target - start
    inside = (local >= 0) & (local < x.shape[-1])
    if not x.shape[-1]:
        return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def _chunk_backward(x, target, start, log_z, entropy, g_logp, g_entropy):
    """∂loss/∂x for one chunk (float32, before the temperature factor); x [c, valid] is overwritten.

    With log p = x − log Z:  ∂/∂x_v = p_v · (−g_logp − g_H · (log p_v + H)) + g_logp · 1[v = y].
    """
    log_p = x.sub_(log_z.unsqueeze(-1))
    probs = log_p.exp()
    offset = -g_logp - g_entropy * entropy
    grad = probs.mul_(log_p.mul_(-g_entropy.unsqueeze(-1)).add_(offset.unsqueeze(-1)))
    local = target - start
    rows = ((local >= 0) & (local < x.shape[-1])).nonzero().squeeze(-1)
    grad[rows, local[rows]] += g_logp[rows]
    return grad


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, temperature, chunk_tokens):
        flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        start, _ = _shard_range(flat.shape[-1], group)
        valid = _valid_columns(flat.shape[-1], start, vocab_size)
        outs = [torch.empty(tgt.shape, dtype=torch.float32, device=logits.device) for _ in range(3)]
        for lo in range(0, flat.shape[0], chunk_tokens):
            x = _scaled(flat[lo : lo + chunk_tokens], valid, temperature)
            for out, value in zip(outs, _chunk_forward(x, tgt[lo : lo + chunk_tokens], start, group)):
                out[lo : lo + chunk_tokens] = value
        log_probs, log_z, entropy = outs
        ctx.save_for_backward(logits, target, log_z, entropy)
        ctx.args = (start, valid, temperature, chunk_tokens)
        return log_probs.view(target.shape), entropy.view(target.shape)

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, target, log_z, entropy = ctx.saved_tensors
        start, valid, temperature, chunk_tokens = ctx.args
        flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        g_logp = _grad_or_zeros(g_logp, tgt).reshape(-1).float()
        g_entropy = _grad_or_zeros(g_entropy, tgt).reshape(-1).float()
        grad = torch.empty_like(flat)
        grad[:, valid:] = 0  # vocabulary padding
        for lo in range(0, flat.shape[0], chunk_tokens):
            hi = lo + chunk_tokens
            x = _scaled(flat[lo:hi], valid, temperature)
            part = _chunk_backward(x, tgt[lo:hi], start, log_z[lo:hi], entropy[lo:hi], g_logp[lo:hi], g_entropy[lo:hi])
            grad[lo:hi, :valid] = part.div_(temperature) if temperature != 1.0 else part
        return grad.view(logits.shape), None, None, None, None, None


def _grad_or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if grad is None else grad


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), both float32 [...], from this rank's vocabulary shard of the logits.

    logits: [..., V/tp] (TP rank r holds columns [r·V/tp, (r+1)·V/tp)); target: [...] global token ids;
    vocab_size: the real vocabulary (columns past it are padding); temperature divides the logits.
    Differentiable with respect to `logits`.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim"
            f" {tuple(logits.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    return _VocabParallelLogProbs.apply(
        logits, target.long(), tp_group, vocab_size, float(temperature), int(chunk_tokens)
    )
