"""`SdpaAttention`: the local spec's core attention computed by torch's fused attention kernel.

Owns: `SdpaAttention`, megatron-core's `DotProductAttention` (the core attention of the local
layer spec, used where Transformer Engine is absent: CPU, and GPUs without TE) with its forward
done by `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` instead of megatron's
unfused baddbmm → masked softmax → bmm (each [b·heads, s, s] step a separate kernel with its own
autograd node; on CPU torch's SDPA runs a fused flash-attention kernel).

Same math: softmax(q·kᵀ·scale + causal mask)·v with megatron's own scale, head split and
grouped-query expansion (taken from the parent's constructor, so config checks and the state dict
are megatron's); the unfused path's masked scores are -10000 before the softmax, the fused one's
-inf, whose difference (e^-10000) is below fp32 resolution. Used only where it computes exactly
that: a causal self-attention (no mask, or the explicit causal mask the training engine passes on
CPU, `megarl.engine.engine._causal_mask`), vanilla softmax, no sliding window, no attention
dropout while training, no query-key layer scaling, no packed sequences or attention bias;
anything else runs megatron's own forward. Measured with `benchmarks/train_step.py` (2 layers, 4 heads
of 32, one CPU thread, the two paths alternated): no gain on 128 rows of ~15 tokens (0.95–1.02×),
1.13–1.14× tokens/s on 16 rows of ~290; no [b, heads, s, s] scores are kept for the backward pass.
Parity: tests/models/test_sdpa_attention.py (outputs and gradients equal megatron's forward) and
the engine's log-prob parity with `transformers`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    """`DotProductAttention` whose causal self-attention runs through `scaled_dot_product_attention`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        self.fusable = (
            config.softmax_type == "vanilla"
            and self.scale_mask_softmax.window_size is None
            and not config.apply_query_key_layer_scaling
            and self.attn_mask_type == AttnMaskType.causal
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ):
        dropout = self.attention_dropout.p if self.training else 0.0
        if (
            not self.fusable
            or dropout
            or attention_bias is not None
            or packed_seq_params is not None
            or attn_mask_type not in (None, AttnMaskType.causal)
            or not _is_causal(attention_mask, query.shape[0], key.shape[0])
        ):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # [sk, b, ng, hn] → [sk, b, np, hn], as megatron's forward expands them
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        # [s, b, n, hn] → [b, n, s, hn] (views: the head dimension stays contiguous)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        # [b, np, sq, hn] → [sq, b, np·hn]
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)


def _is_causal(mask: Optional[torch.Tensor], sq: int, sk: int) -> bool:
    """No mask (the causal mask type alone), or a boolean [.., sq, sk] mask hiding exactly the future."""
    if mask is None:
        return sq == sk
    if mask.dtype != torch.bool or sq != sk or tuple(mask.shape[-2:]) != (sq, sk) or mask[..., 0, 0].numel() != 1:
        return False
    # an s² comparison: small beside the attention itself (b · heads · s² · head_dim multiply-adds)
    return torch.equal(mask.reshape(sq, sk), torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1))
