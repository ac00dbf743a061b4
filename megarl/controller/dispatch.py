"""Which rank holds which data: a role's rank mesh, DP splitting of a Batch, and result collection.

Owns: `RankCoord` / `RankMesh` (rank -> (dp, tp, pp, cp) in megatron-core's order "tp-cp-dp-pp",
TP fastest and PP slowest, the order `megarl.engine.parallel` builds its groups in) and
`DPSplit` (a Batch's rows dealt to the DP ranks, balanced by token count, and the inverse
permutation that puts collected results back in the original row order).

Every rank of one DP index gets the same shard (its TP/PP/CP peers need the same rows); results
are read from one rank per DP index: the first TP rank, CP rank 0, on the last PP stage (where
log-probs, values and losses are). Pure Python + numpy: no Ray, megatron or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megarl.data.balancing import balance_rows
from megarl.data.batch import Batch
from megarl.models.layout import ParallelLayout


@dataclass(frozen=True)
class RankCoord:
    """A rank's position in its role's parallel grid."""

    rank: int
    dp: int
    tp: int
    pp: int
    cp: int


class RankMesh:
    """rank <-> (dp, tp, pp, cp) of one role spanning `world_size` ranks (rank = tp + TP*(cp + CP*(dp + DP*pp)))."""

    def __init__(self, layout: ParallelLayout, world_size: int):
        self.layout = layout
        self.world_size = world_size
        self.dp_size = layout.dp_size(world_size)
        self.coords = [self._coord(rank) for rank in range(world_size)]

    def _coord(self, rank: int) -> RankCoord:
        tp, rest = rank % self.layout.tp, rank // self.layout.tp
        cp, rest = rest % self.layout.cp, rest // self.layout.cp
        dp, pp = rest % self.dp_size, rest // self.dp_size
        return RankCoord(rank=rank, dp=dp, tp=tp, pp=pp, cp=cp)

    def ranks_of_dp(self, dp: int) -> list[int]:
        """Every rank that works on DP shard `dp` (its TP, CP and PP peers)."""
        return [c.rank for c in self.coords if c.dp == dp]

    def collect_ranks(self) -> list[int]:
        """One rank per DP index, in DP order: TP rank 0, CP rank 0, last PP stage."""
        last = self.layout.pp - 1
        by_dp = {c.dp: c.rank for c in self.coords if c.tp == 0 and c.cp == 0 and c.pp == last}
        return [by_dp[d] for d in range(self.dp_size)]

    def __repr__(self) -> str:
        lay = self.layout
        return f"RankMesh(world={self.world_size}, dp={self.dp_size}, tp={lay.tp}, pp={lay.pp}, cp={lay.cp})"


def row_lengths(batch: Batch) -> np.ndarray:
    """Tokens per row (attention_mask sum; rows count equally without a mask)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(-1).cpu().numpy()
    return np.ones(len(batch), dtype=np.int64)


@dataclass
class DPSplit:
    """A batch's rows dealt to `dp` ranks; `restore` puts per-shard results back in row order."""

    shards: list[Batch]
    """Shard d goes to every rank of DP index d."""
    indices: list[np.ndarray]
    """Original row indices of each shard."""

    @classmethod
    def of(cls, batch: Batch, dp: int, *, balance: bool = True, group_key: Optional[str] = None) -> "DPSplit":
        """Split `batch` into `dp` shards of equal row count (balanced by tokens when `balance`).

        group_key: a column of group ids whose rows must stay on one rank (e.g. GRPO's "uid").
        """
        if len(batch) % dp:
            raise ValueError(
                f"{len(batch)} rows cannot be split evenly over data-parallel size {dp}; the config's"
                " samples per step must be divisible by every role's DP size (megarl.config.validate)"
            )
        if balance:
            groups = batch[group_key] if group_key else None
            parts = balance_rows(row_lengths(batch), dp, group_ids=groups, keep_groups=group_key is not None)
            indices = [np.asarray(p, dtype=np.int64) for p in parts]
        else:
            indices = list(np.arange(len(batch)).reshape(dp, -1))
        return cls(shards=[batch[idx] for idx in indices], indices=indices)

    def restore(self, results: Sequence[Batch]) -> Batch:
        """Per-shard results (row-aligned with the shards) concatenated back in the original row order."""
        if len(results) != len(self.shards):
            raise ValueError(f"expected {len(self.shards)} shard results, got {len(results)}")
        for d, (res, idx) in enumerate(zip(results, self.indices)):
            if len(res) != len(idx):
                raise ValueError(f"result of DP shard {d} has {len(res)} rows, its input had {len(idx)}")
        merged = Batch.concat(list(results))
        order = np.argsort(np.concatenate(self.indices), kind="stable")
        return merged[order]
