"""Parallel layouts of a model role (TP, PP, virtual PP, CP, EP) and their validation.

Owns: the `ParallelLayout` dataclass and the checks that a layout fits a model's sizes.
Must not import megatron, vLLM or Ray (it is used to validate configs before any worker starts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout does not fit the model or the world size."""


@dataclass(frozen=True)
class ParallelLayout:
    """How one role's model is split over ranks. DP is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size (attention heads and MLP columns split across ranks)."""
    pp: int = 1
    """Pipeline-parallel size (contiguous layer ranges per stage)."""
    vpp: int = 1
    """Virtual pipeline stages per PP rank (interleaved schedule); 1 disables it."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks)."""
    ep: int = 1
    """Expert-parallel size (MoE experts split across ranks)."""

    def __post_init__(self):
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"layout.{name}={value!r}: must be a positive integer")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"layout.vpp={self.vpp} needs pp > 1 (virtual stages interleave pipeline stages)")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one full copy of the model."""
        return self.tp * self.pp * self.cp

    @property
    def min_world_size(self) -> int:
        """Fewest ranks that run this layout: one model copy, plus the DP ranks EP is carved from (ep | dp*cp)."""
        return self.model_parallel_size * (self.ep // math.gcd(self.ep, self.cp))

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; raises when the layout does not divide it."""
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
                f" = {self.model_parallel_size}; change the number of GPUs or the layout"
            )
        return world_size // self.model_parallel_size

    def check_dims(self, dims) -> None:
        """`check_model` for a `ModelDims` (anything with num_layers, num_heads, num_kv_heads[, num_experts])."""
        self.check_model(
            num_layers=dims.num_layers,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            num_experts=getattr(dims, "num_experts", 0),
        )

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int, num_experts: int = 0) -> None:
        """Raise `LayoutError` naming the sizes that do not divide, before any weight is read."""
        if num_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_heads} is not divisible by tp={self.tp}; pick a tp that divides it"
            )
        if num_kv_heads % self.tp:
            raise LayoutError(
                f"num_key_value_heads={num_kv_heads} is not divisible by tp={self.tp}; megatron-core splits"
                f" query groups across TP ranks, so tp must divide {num_kv_heads}"
            )
        stages = self.pp * self.vpp
        if num_layers % stages:
            raise LayoutError(
                f"num_hidden_layers={num_layers} is not divisible by pp*vpp = {self.pp}*{self.vpp} = {stages};"
                f" pick pp/vpp so that every (virtual) stage gets the same number of layers"
            )
        if num_experts and num_experts % self.ep:
            raise LayoutError(
                f"num_experts={num_experts} is not divisible by ep={self.ep}; pick an ep that divides"
                " the number of experts (every EP rank holds the same number of experts)"
            )
        if not num_experts and self.ep > 1:
            raise LayoutError(f"ep={self.ep} needs a mixture-of-experts model; this model is dense")
