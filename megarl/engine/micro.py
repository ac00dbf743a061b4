"""Micro-batches for the engine: padding removed per row, packed by a token budget.

Owns: `MicroBatch` and `make_micro_batches`. Input rows are a left-padded prompt followed by a
right-padded response (`input_ids`, `attention_mask` [B, L]; the response is the last T columns,
T = `response_mask.shape[1]`). Each row's real tokens are contiguous, so a micro-batch shifts every
row left to start at column 0 (positions 0, 1, ...) and pads on the right only: under the causal
mask, right padding never influences a real token, so outputs equal `transformers` on the unpadded
sequence. `MicroBatch.to_response` maps a per-position model output back to response columns.

With context parallelism the engine attaches a `CPShard`: `model_inputs` / `local_targets` give
this CP rank's zigzag columns (`context.split_for_cp`) and `gather_cp` puts a per-position output
of those columns back into the full [b, S] frame, so heads and `to_response` see the cp=1 frame.

Imports only torch, numpy, megarl.data and megarl.engine.context (no megatron, vLLM or Ray).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megarl.data.balancing import balance_rows, pack_micro_batches
from megarl.data.batch import Batch
from megarl.engine.context import CPShard, gather_from_cp, split_for_cp


@dataclass
class MicroBatch:
    """Rows of one micro-batch in the unpadded frame, plus the original rows for the loss."""

    rows: np.ndarray
    """Indices of these rows in the engine's (local) batch."""
    tokens: torch.Tensor
    """[b, S] token ids, each row shifted to start at column 0, right-padded with 0."""
    position_ids: torch.Tensor
    """[b, S] 0, 1, 2, ... (the shift makes every row start at position 0)."""
    targets: torch.Tensor
    """[b, S] next token of each position (0 past the end)."""
    first: torch.Tensor
    """[b] column of each row's first real token in the original [B, L] frame."""
    lengths: torch.Tensor
    """[b] real tokens per row."""
    seq_len: int
    """L: columns of the original input."""
    batch: Batch
    """The original rows (response_mask, advantages, old_log_probs, ... for the loss function)."""
    cp: Optional[CPShard] = None
    """This rank's context-parallel shard (None: the rank holds whole rows)."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.cp is None else split_for_cp(x, self.cp.size, self.cp.rank)

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, position_ids) this rank feeds the model: [b, S], or its CP columns [b, S/cp]."""
        return self._split(self.tokens), self._split(self.position_ids)

    def local_targets(self) -> torch.Tensor:
        """Targets of the positions this rank's model output covers ([b, S] or [b, S/cp])."""
        return self._split(self.targets)

    def gather_cp(self, local: torch.Tensor) -> torch.Tensor:
        """A per-position output of this rank's columns back in the full [b, S, ...] frame (all CP ranks)."""
        return gather_from_cp(local, self.cp)

    def to_response(self, frame: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """Response columns [b, T, ...] of a per-position tensor [b, S, ...].

        shift=1: the output that *predicts* response token t (log-probs, values: position p − 1);
        shift=0: the output *at* response token t (reward model score at the last token).
        Columns without a source position (response padding) read position 0; mask them out.
        """
        frame = frame[: len(self.rows)]  # drop filler rows of fixed-shape micro-batches
        response_len = self.batch["response_mask"].shape[1]
        columns = torch.arange(self.seq_len - response_len, self.seq_len)
        index = columns.unsqueeze(0) - shift - self.first.unsqueeze(1)
        index = torch.minimum(index.clamp(min=0), (self.lengths - 1).clamp(min=0).unsqueeze(1))
        index = index.to(frame.device)
        if frame.dim() == 2:
            return frame.gather(1, index)
        return frame.gather(1, index.unsqueeze(-1).expand(-1, -1, *frame.shape[2:]))


def row_lengths(batch: Batch) -> np.ndarray:
    """Real tokens per row (attention_mask sums)."""
    return batch["attention_mask"].sum(-1).cpu().numpy().astype(np.int64)


def make_micro_batch(batch: Batch, rows: np.ndarray, width: int = 0, num_rows: int = 0) -> MicroBatch:
    """Shift the chosen rows left (drop left padding) and trim to the longest of them.

    `width` / `num_rows` pad to a fixed shape [num_rows, width] (filler rows are all padding): the
    interleaved pipeline schedule needs every micro-batch to have the same shape.
    """
    mask = batch["attention_mask"][rows].bool()
    ids = batch["input_ids"][rows]
    lengths = mask.sum(-1)
    first = mask.long().argmax(-1)
    width = max(int(lengths.max()), 1, width)
    cols = first.unsqueeze(1) + torch.arange(width).unsqueeze(0)
    inside = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = torch.where(inside, ids.gather(1, cols.clamp(max=ids.shape[1] - 1)), torch.zeros_like(ids[:, :1]))
    targets = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    if num_rows > len(rows):
        filler = torch.zeros(num_rows - len(rows), width, dtype=tokens.dtype)
        tokens, targets = torch.cat([tokens, filler]), torch.cat([targets, filler])
    positions = torch.arange(width).unsqueeze(0).expand(tokens.shape[0], -1).contiguous()
    return MicroBatch(np.asarray(rows), tokens, positions, targets, first, lengths, ids.shape[1], batch[rows])


def make_micro_batches(
    batch: Batch, max_tokens: int, min_micro_batches: int = 1, fixed_shape: bool = False, width_multiple: int = 1
) -> list[MicroBatch]:
    """Micro-batches of at most `max_tokens` real tokens each (a longer row gets its own).

    fixed_shape: pad all to the same [rows, width] (the step's longest row, the fullest pack).
    width_multiple: round each width up to a multiple (sequence parallelism splits it over TP).
    """
    lengths = row_lengths(batch)
    packs = pack_micro_batches(lengths, max_tokens, min_micro_batches)
    step_width = int(lengths.max()) if fixed_shape else 0
    num_rows = max(len(p) for p in packs) if fixed_shape else 0
    widths = [max(step_width, int(lengths[p].max()), 1) for p in packs]
    widths = [-(-w // width_multiple) * width_multiple for w in widths]
    return [make_micro_batch(batch, np.asarray(rows), w, num_rows) for rows, w in zip(packs, widths)]


def shard_for_dp(batch: Batch, dp_size: int, dp_rank: int) -> Batch:
    """This DP rank's rows, balanced by token count (the same answer on every rank)."""
    if dp_size == 1:
        return batch
    parts = balance_rows(row_lengths(batch), dp_size)
    return batch[np.sort(np.asarray(parts[dp_rank]))]
