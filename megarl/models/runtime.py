"""Megatron-core process state for SPMD tools: model-parallel groups, CPU patches, seeds.

Owns: `init_megatron(layout)` for tools that own the whole world (conversion, parity). The
training engine builds per-role process-group collections instead of this global state.
"""

from __future__ import annotations

import torch

from megarl.models.layout import ParallelLayout


def init_megatron(layout: ParallelLayout, seed: int = 1234) -> None:
    """Apply the CPU patches (CPU only), create megatron's global model-parallel groups, seed RNGs."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_patches import apply_cpu_patches

    apply_cpu_patches()
    layout.dp_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def ranks() -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank) of this process in megatron's global groups."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def expert_ranks() -> tuple[int, object]:
    """(EP rank, EP group) of this process in megatron's global groups (rank 0 and None without EP)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return 0, None
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group()
