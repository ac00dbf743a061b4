"""The reference role: a frozen policy the KL terms are measured against (no optimizer).

Reads: input_ids, attention_mask, response_mask. Writes: ref_log_probs. May share the actor's
processes with its own layout. Must not import vLLM or Ray.
"""

from __future__ import annotations

from megarl.data.batch import Batch
from megarl.engine.heads import LogProbHead
from megarl.utils.remote import ROWS, remote
from megarl.workers.base import EngineRole, build_engine


class Reference(EngineRole):
    """Log-probs of the frozen reference policy at the rollout temperature."""

    name = "ref"

    def __init__(self, engine, temperature: float = 1.0, offload: bool = False):
        super().__init__(engine, offload)
        self.head = LogProbHead.of(engine, temperature)

    @classmethod
    def from_config(cls, cfg, first: bool = False) -> "Reference":
        engine = build_engine(cfg, "ref", first=first, hf_path=cfg.ref.hf_path)
        ref = cls(engine, cfg.rollout.temperature or 1.0, cfg.ref.offload)
        ref.publish()
        return ref

    @remote(ROWS)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """ref_log_probs [B, T] of the batch's responses."""
        return Batch.from_dict({"ref_log_probs": self.engine.forward(batch, self.head)["log_probs"]})
