"""Loss aggregation: how a per-token loss matrix [B, T] becomes one scalar.

Four modes, registered in `LOSS_AGGREGATIONS` (signature `fn(loss_mat, mask, agg) -> scalar`):

    token-mean               Σ_{i,t} l·m / N_tokens
    seq-mean-token-sum       Σ_i (Σ_t l·m) / N_seqs
    seq-mean-token-mean      Σ_i (Σ_t l·m / Σ_t m) / N_seqs
    seq-mean-token-sum-norm  Σ_{i,t} l·m / (N_seqs · max_response_len)      (Dr. GRPO)

N_tokens (masked tokens) and N_seqs (rows with at least one masked token) are the GLOBAL counts of
the whole optimizer step — all DP ranks, all micro-batches — carried in `LossAggregation`. Each
shard then divides its own partial sum by the global count, so summing the shard losses (and
their gradients) gives exactly the unsplit result, whatever the DP size or micro-batch split.
Megatron's DDP *averages* gradients over DP ranks, so an engine using it multiplies the loss by
the DP size. Left as None, a count is taken from the call's own mask (right when unsplit).

Imports only torch.
"""

from dataclasses import dataclass

import torch

from megarl.algorithms.masked import masked_sum
from megarl.utils.registry import Registry

LOSS_AGGREGATIONS = Registry("loss aggregation", ("loss_mat", "mask", "agg"))
register_loss_aggregation = LOSS_AGGREGATIONS.register


@dataclass(frozen=True)
class LossAggregation:
    """An aggregation mode plus the global denominators of the step it normalises by."""

    mode: str = "token-mean"
    """Name in LOSS_AGGREGATIONS: token-mean, seq-mean-token-{sum,mean}, seq-mean-token-sum-norm."""
    global_tokens: float | None = None
    """Loss tokens in the whole step (all ranks and micro-batches); None: this call's count."""
    global_seqs: float | None = None
    """Rows with at least one loss token in the whole step; None: this call's count."""
    max_response_len: int | None = None
    """Constant divisor of seq-mean-token-sum-norm (the rollout's max response length)."""

    def __post_init__(self):
        LOSS_AGGREGATIONS.get(self.mode)
        if self.mode == "seq-mean-token-sum-norm" and not self.max_response_len:
            raise ValueError("seq-mean-token-sum-norm needs max_response_len (the rollout's limit)")

    @classmethod
    def for_batch(cls, mode: str, response_mask: torch.Tensor, max_response_len: int | None = None):
        """Global denominators computed from the full step's mask [B, T] (all micro-batches).

        Counts are floored at 1, so a step without loss tokens gives loss 0, not NaN.
        """
        tokens, seqs = loss_denominators(response_mask)
        return cls(mode, max(float(tokens), 1.0), max(float(seqs), 1.0), max_response_len)


def loss_denominators(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, seqs) of a mask [B, T]: masked tokens and rows with ≥ 1 of them.

    On DP ranks, all-reduce (sum) these local counts to get the global ones.
    """
    mask = response_mask.bool()
    return mask.sum(), mask.any(-1).sum()


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAggregation) -> torch.Tensor:
    """Scalar loss from a per-token loss [B, T] with the aggregation `agg` (global denominators)."""
    return LOSS_AGGREGATIONS.get(agg.mode)(loss_mat, mask, agg)


def _tokens(mask, agg) -> float | torch.Tensor:
    return agg.global_tokens if agg.global_tokens is not None else loss_denominators(mask)[0].clamp(min=1)


def _seqs(mask, agg) -> float | torch.Tensor:
    return agg.global_seqs if agg.global_seqs is not None else loss_denominators(mask)[1].clamp(min=1)


@register_loss_aggregation("token-mean")
def token_mean(loss_mat, mask, agg):
    """Σ_{i,t} l·m / N_tokens: every token weighs the same."""
    return masked_sum(loss_mat, mask) / _tokens(mask, agg)


@register_loss_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat, mask, agg):
    """Σ_i (Σ_t l·m) / N_seqs: sequence losses summed over their tokens, averaged over sequences."""
    return masked_sum(loss_mat, mask) / _seqs(mask, agg)


@register_loss_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, mask, agg):
    """Σ_i (Σ_t l·m / Σ_t m) / N_seqs: every sequence weighs the same, whatever its length."""
    seq_tokens = mask.sum(-1).clamp(min=1).to(loss_mat.dtype)
    return (masked_sum(loss_mat, mask, dim=-1) / seq_tokens).sum() / _seqs(mask, agg)


@register_loss_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, mask, agg):
    """Σ_{i,t} l·m / (N_seqs · max_response_len): Dr. GRPO's length-unbiased constant normaliser."""
    return masked_sum(loss_mat, mask) / (_seqs(mask, agg) * agg.max_response_len)
