"""The HF ↔ megatron-core model bridge: build a role's GPTModel chunks and move weights both ways.

Owns: `ModelBridge`, which ties an HF config (`hf_config.py`), a parallel layout (`layout.py`),
the model spec (`spec.py`) and the weight tables (`weight_map.py`, rules in `mapping.py`). Loading streams one HF tensor at a
time into the local shard; export gathers TP shards (and, for MoE experts, the EP ranks' experts)
one parameter at a time. Used by the conversion CLI, the training engine and the sharding manager.

Expert TP is megatron-core's default, the TP size, and its groups hold the same ranks as the TP
groups (TP is the fastest rank dimension of both grids), so a rank's expert-TP rank is its TP rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from megarl.models import spec
from megarl.models.hf_config import describe_hf_config, load_hf_config
from megarl.models.hf_io import HFCheckpointReader
from megarl.models.layout import ParallelLayout
from megarl.models.weight_map import WeightMap

logger = logging.getLogger(__name__)


class ModelBridge:
    """One model (actor, reference, critic or reward) at one parallel layout."""

    def __init__(
        self,
        hf_config,
        layout: ParallelLayout = ParallelLayout(),
        *,
        dtype=torch.float32,
        value_head: bool = False,
        vocab_divisible_by: int = 128,
    ):
        self.hf_config = hf_config
        self.dims = describe_hf_config(hf_config)
        layout.check_dims(self.dims)
        self.layout = layout
        self.dtype = dtype
        self.value_head = value_head
        self.vocab_divisible_by = vocab_divisible_by
        self.weight_map = WeightMap(self.dims, value_head=value_head)

    @classmethod
    def from_hf_path(cls, path: str | Path, layout: ParallelLayout = ParallelLayout(), **kwargs) -> "ModelBridge":
        return cls(load_hf_config(path), layout, **kwargs)

    def transformer_config(self, **overrides):
        return spec.transformer_config(self.dims, self.layout, self.dtype, **overrides)

    def build(self, pp_rank: int = 0, *, config=None, pg_collection=None) -> list[torch.nn.Module]:
        """The model chunks of pipeline rank `pp_rank` (one per virtual stage)."""
        config = config or self.transformer_config()
        return spec.build_model_chunks(
            self.dims,
            config,
            pp_rank=pp_rank,
            hf_config=self.hf_config,
            value_head=self.value_head,
            pg_collection=pg_collection,
            vocab_divisible_by=self.vocab_divisible_by,
        )

    def _lookup(self, name: str, layer_offset: int, ep_rank: int):
        return self.weight_map.lookup(name, layer_offset, ep_rank * self.weight_map.local_experts(self.layout.ep))

    def _chunk_params(self, chunks, pp_rank: int):
        """(chunk-local name, parameter, layer offset) for every parameter of every chunk."""
        for vp_stage, chunk in enumerate(chunks):
            offset = spec.layer_offset(chunk.config, pp_rank, vp_stage if len(chunks) > 1 else None)
            for name, param in _unwrap(chunk).named_parameters():
                yield name, param, offset

    def load_hf_weights(
        self,
        chunks,
        source,
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        ep_rank: int = 0,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        """Copy this rank's shards from an HF checkpoint (path or reader) into `chunks`, one tensor at a time."""
        reader = source if isinstance(source, HFCheckpointReader) else HFCheckpointReader(source)
        plan = [(p, self._lookup(n, off, ep_rank)) for n, p, off in self._chunk_params(chunks, pp_rank)]
        plan = [(p, m) for p, m in plan if not self._keeps_fresh_head(m, reader)]
        reader.check_has(name for _, m in plan for name in m.hf)
        padded = _padded_vocab(chunks)
        for param, mapping in plan:
            with torch.no_grad():  # only this rank's rows are read, straight into the parameter
                mapping.load_shard(reader, self.dims, padded, tp_rank, self.layout.tp, param)
            if progress:
                progress(mapping.mcore)

    def count_hf_tensors(self, chunks, pp_rank: int = 0) -> int:
        """How many tensors `iter_hf_weights` yields for these chunks (expert weights: of every EP rank)."""
        mappings = [
            self.weight_map.lookup(name, offset)
            for name, _, offset in self._chunk_params(chunks, pp_rank)
            if not self.weight_map.is_tied_copy(name)
        ]
        return sum(len(m.hf) * (self.layout.ep if m.expert else 1) for m in mappings)

    def _keeps_fresh_head(self, mapping, reader: HFCheckpointReader) -> bool:
        """A critic started from a causal-LM checkpoint has no `score.weight`: its value head keeps its init."""
        if not (self.value_head and mapping.hf == ("score.weight",) and "score.weight" not in reader):
            return False
        logger.info("%s has no score.weight: the value head starts from its random init", reader.path)
        return True

    def iter_hf_weights(
        self, chunks, *, pp_rank: int = 0, tp_group=None, ep_group=None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of this pipeline stage, one parameter at a time: TP shards are gathered,
        and each local expert weight is gathered over EP into the weights of every EP rank's expert.

        Collective over the TP and EP groups: every rank of a stage drains the iterator.
        """
        ep_size = self.layout.ep
        for name, param, offset in self._chunk_params(chunks, pp_rank):
            if self.weight_map.is_tied_copy(name):
                continue
            mapping = self.weight_map.lookup(name, offset)
            shards = [param.detach()] if mapping.tp_dim is None else _gather(param.detach(), tp_group, self.layout.tp)
            full = mapping.unshard(shards)
            if not mapping.expert:
                yield from zip(mapping.hf, mapping.to_hf(full, self.dims))
                continue
            for ep_rank, expert_full in enumerate(_gather(full, ep_group, ep_size)):
                expert_mapping = self._lookup(name, offset, ep_rank)
                yield from zip(expert_mapping.hf, expert_mapping.to_hf(expert_full, self.dims))


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _padded_vocab(chunks) -> int:
    return _unwrap(chunks[0]).vocab_size


def _gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's `tensor` of a TP or EP group, in group-rank order."""
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
    return shards
