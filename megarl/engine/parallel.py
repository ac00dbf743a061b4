"""Per-role process groups: one megatron-core `ProcessGroupCollection` per role and layout.

Owns: `RoleGroups` (a role's layout, ranks and explicit process groups) and `build_role_groups`,
which builds them from `HyperCommGrid`s over the role's rank span. Two roles that share processes
(actor TP2 and critic TP1×DP2 on the same two ranks) each get their own collection, so neither
depends on megatron's global `parallel_state`.

Rank order inside a role is megatron's default "tp-cp-ep-dp-pp" (TP fastest, PP slowest), the
same as `initialize_model_parallel`, so checkpoints and conversion tools agree on who holds what.

Global state: megatron's `initialize_model_parallel` is never called; `init_global_state` sets up
the only two process-wide pieces megatron-core 0.19.2 still needs (attention workspace buffer, RNG
tracker), neither of which depends on a layout.

Must not import vLLM or Ray. Creating groups is collective: every process of the world calls
`build_role_groups` for every role, in the same order, even for roles it is not part of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.layout import LayoutError, ParallelLayout

_DENSE_DIMS = ["tp", "cp", "dp", "pp"]
_EXPERT_DIMS = ["expt_tp", "ep", "expt_dp", "pp"]


@dataclass
class RoleGroups:
    """One role's layout, rank span and explicit process groups (pg is None off the role's ranks)."""

    layout: ParallelLayout
    """The role's TP/PP/VPP/CP/EP sizes."""
    world_size: int
    """Ranks the role spans (tp * pp * cp * dp)."""
    rank_offset: int
    """First global rank of the role."""
    pg: Optional[object]
    """megatron-core ProcessGroupCollection for this rank; None when the rank is not in the role."""

    @property
    def is_member(self) -> bool:
        return self.pg is not None

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size(self.world_size)

    @property
    def tp_rank(self) -> int:
        return self.pg.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pg.pp.rank()

    @property
    def dp_rank(self) -> int:
        return self.pg.dp.rank()

    @property
    def cp_rank(self) -> int:
        return self.pg.cp.rank()

    @property
    def ep_rank(self) -> int:
        """Expert-parallel rank: this rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return self.pg.ep.rank()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


def check_layout(
    layout: ParallelLayout,
    world_size: int,
    *,
    num_layers: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> int:
    """DP size of `layout` over `world_size` ranks; `LayoutError` naming what does not divide."""
    dp = layout.dp_size(world_size)
    if layout.ep > 1 and (dp * layout.cp) % layout.ep:
        raise LayoutError(
            f"ep={layout.ep} must divide dp*cp = {dp}*{layout.cp} (experts are split over"
            " the data-parallel ranks of a stage)"
        )
    if num_layers is not None:
        layout.check_model(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return dp


def build_role_groups(layout: ParallelLayout, world_size: Optional[int] = None, rank_offset: int = 0) -> RoleGroups:
    """Create a role's process groups over ranks [rank_offset, rank_offset + world_size) (collective)."""
    world_size = world_size or dist.get_world_size() - rank_offset
    if rank_offset + world_size > dist.get_world_size():
        raise LayoutError(
            f"role spans ranks {rank_offset}..{rank_offset + world_size - 1} but the world"
            f" has only {dist.get_world_size()}"
        )
    dp = check_layout(layout, world_size)
    member = rank_offset <= dist.get_rank() < rank_offset + world_size
    pg = _collection(layout, dp, rank_offset, member)
    return RoleGroups(layout, world_size, rank_offset, pg if member else None)


def _grid(shape, names, rank_offset):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    return HyperCommGrid(shape, names, rank_offset=rank_offset)


def _collection(layout: ParallelLayout, dp: int, rank_offset: int, member: bool):
    """All groups megatron's model, DDP, optimizer, schedules and checkpointing ask for."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    dense = _grid([layout.tp, layout.cp, dp, layout.pp], _DENSE_DIMS, rank_offset)
    expt_dp = dp * layout.cp // layout.ep
    expert = _grid([layout.tp, layout.ep, expt_dp, layout.pp], _EXPERT_DIMS, rank_offset)
    groups = {name: dense.create_pg(dims) for name, dims in _DENSE_GROUPS.items()}
    groups.update({name: expert.create_pg(dims) for name, dims in _EXPERT_GROUPS.items()})
    groups.update(_embedding_groups(dense.get_rank_enum("pp")))
    groups["intra_dist_opt"] = groups["world"]
    groups.pop("world")
    return ProcessGroupCollection(**groups) if member else None


_DENSE_GROUPS = {
    "tp": ["tp"],
    "cp": ["cp"],
    "dp": ["dp"],
    "pp": ["pp"],
    "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"],
    "dp_cp": ["cp", "dp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
    "world": ["tp", "cp", "dp", "pp"],
}
_EXPERT_GROUPS = {
    "ep": ["ep"],
    "expt_tp": ["expt_tp"],
    "expt_dp": ["expt_dp"],
    "tp_ep": ["expt_tp", "ep"],
    "tp_ep_pp": ["expt_tp", "ep", "pp"],
}


def _embedding_groups(pp_rank_lists: list[list[int]]) -> dict:
    """Word-embedding group (first + last stage: tied embeddings) and position-embedding group (first)."""
    rank = dist.get_rank()
    found = {"embd": None, "pos_embd": None}
    for ranks in pp_rank_lists:
        embd_ranks = ranks if len(ranks) == 1 else [ranks[0], ranks[-1]]
        for name, members in (("embd", embd_ranks), ("pos_embd", ranks[:1])):
            group = dist.new_group(ranks=members)
            if rank in members:
                found[name] = group
    return found


def init_global_state(groups: RoleGroups, seed: int = 1234) -> None:
    """Set up the process-wide megatron-core state that no process-group collection replaces; seed RNGs.

    With every group passed explicitly, megatron-core 0.19.2 still needs two process-wide things,
    neither tied to a layout (found by training TP2, PP2 and a TP1×DP2 critic, and saving a
    checkpoint, without `initialize_model_parallel`):
      * the global memory buffer (`parallel_state._GLOBAL_MEMORY_BUFFER`), the attention workspace of
        the local-spec `DotProductAttention`;
      * the model-parallel RNG tracker (`model_parallel_cuda_manual_seed`), one per process: its
        TP-rank stream is seeded from the role given here (it only drives dropout and on-device
        init, and dropout is 0 for RL fine-tuning; weights come from the checkpoint).
    `parallel_state.initialize_model_parallel` is deliberately *not* called, so no role's layout is
    global and any megatron code that still read it would fail loudly instead of using the wrong
    groups. Call once per process, after building the first role's groups.
    """
    from megatron.core import parallel_state, tensor_parallel

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed,
        tp_rank=groups.tp_rank,
        ep_rank=groups.pg.ep.rank(),
        etp_rank=groups.pg.expt_tp.rank(),
        force_reset_rng=True,
    )
