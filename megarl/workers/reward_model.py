"""The reward-model role: a scalar-head model scoring each response (model-based reward).

Reads: input_ids, attention_mask, response_mask. Writes: rm_scores (the score at each row's last
response token). No optimizer. Must not import vLLM or Ray.
"""

from __future__ import annotations

from megarl.data.batch import Batch
from megarl.engine.heads import ScoreHead
from megarl.utils.remote import ROWS, remote
from megarl.workers.base import EngineRole, build_engine


class RewardModel(EngineRole):
    """A scalar-head model scoring each row at its last response token."""

    name = "reward_model"

    def __init__(self, engine, offload: bool = False):
        super().__init__(engine, offload)
        self.head = ScoreHead()

    @classmethod
    def from_config(cls, cfg, first: bool = False) -> "RewardModel":
        engine = build_engine(cfg, "reward_model", first=first, value_head=True, hf_path=cfg.reward_model.hf_path)
        model = cls(engine, cfg.reward_model.offload)
        model.publish()
        return model

    @remote(ROWS)
    def compute_scores(self, batch: Batch) -> Batch:
        """rm_scores [B]: the model's score of each response."""
        return Batch.from_dict({"rm_scores": self.engine.forward(batch, self.head)["scores"]})
