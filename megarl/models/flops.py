"""Model FLOPs of a training step, for MFU (model FLOPs utilisation).

Owns: `train_flops` (6·N·T for the weights, forward + backward, plus causal attention) and
`PEAK_BF16_TFLOPS` (dense bf16 peaks by GPU name). Pure torch; no megatron.
"""

from __future__ import annotations

import torch

from megarl.models.hf_config import ModelDims

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 peak TFLOP/s of one GPU, by a substring of its name."""


def weight_params(dims: ModelDims) -> int:
    """Parameters that take part in every token's matmuls (embedding lookup excluded, output layer included).

    MoE: a token runs the router, its top-k experts and the shared expert (the active parameters).
    """
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    per_layer = dims.hidden_size * (2 * q + 2 * kv) + 3 * dims.hidden_size * _active_ffn(dims)
    if dims.moe:
        per_layer += dims.hidden_size * (dims.moe.num_experts + int(dims.moe.shared_expert_gate))
    return dims.num_layers * per_layer + dims.vocab_size * dims.hidden_size


def _active_ffn(dims: ModelDims) -> int:
    """Intermediate width a token passes through: the dense MLP's, or top-k experts' plus the shared expert's."""
    if dims.moe is None:
        return dims.ffn_hidden_size
    return dims.moe.topk * dims.moe.ffn_hidden_size + dims.moe.shared_expert_ffn_hidden_size


def train_flops(dims: ModelDims, lengths: torch.Tensor) -> float:
    """FLOPs of one forward + backward over sequences of `lengths` tokens: 6·N·T + 6·L·d·Σ s²/2·2 (causal)."""
    lengths = lengths.double()
    attention = 6 * dims.num_layers * dims.num_heads * dims.head_dim * (lengths**2).sum()
    return float(6 * weight_params(dims) * lengths.sum() + attention)
