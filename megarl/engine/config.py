"""Typed configuration of a Megatron training engine (one role).

Owns: `OptimConfig` (Adam, LR schedule, clipping) and `EngineConfig` (layout, precision, token
budget, seed). Defaults live here; YAML only overrides. Must not import megatron, vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.models.layout import ParallelLayout

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass
class OptimConfig:
    """Adam with decoupled weight decay, warm-up then decay of the learning rate, grad-norm clipping."""

    lr: float = 1e-6
    """Peak learning rate (reached after `warmup_steps`)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    decay_steps: Optional[int] = None
    """Optimizer steps until `min_lr` (None: as many as the warm-up + 1, i.e. no decay with 'constant')."""
    decay_style: str = "constant"
    """LR decay after warm-up: constant, linear, cosine or inverse-square-root."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Global grad-norm clipping threshold (0 disables)."""

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style={self.decay_style!r} is not one of {DECAY_STYLES}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr; got min_lr={self.min_lr}, lr={self.lr}")


@dataclass
class EngineConfig:
    """One role's model engine: parallel layout, precision, micro-batch token budget, optimizer."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """TP/PP/VPP/CP/EP of this role (DP = ranks / (tp·pp·cp))."""
    dtype: str = "auto"
    """Parameter dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (real tokens, padding removed); a longer row gets its own."""
    optim: Optional[OptimConfig] = None
    """Optimizer; None builds a forward-only engine (reference, reward model)."""
    recompute: bool = False
    """Full activation recompute of every layer (trades compute for memory)."""
    seed: int = 1234
    """Seed of the model-parallel RNG tracker and torch."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the vocab-parallel log-prob / entropy computation."""

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: use auto, float32 or bfloat16")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1; got {self.micro_batch_tokens}")
