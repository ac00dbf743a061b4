"""The critic role: the value model (the policy's backbone + a scalar head) that GAE needs.

Owns `Critic` and its objective `critic_loss` (the clipped value loss, one aggregation mode).
Reads: input_ids, attention_mask, response_mask; for the update also values (before the update)
and returns. Writes: values. Must not import vLLM or Ray.
"""

from __future__ import annotations

from megarl.algorithms import ValueLossConfig, ValueLossInputs, value_loss
from megarl.data.batch import Batch
from megarl.engine.heads import ValueHead, aggregation
from megarl.engine.micro import MicroBatch
from megarl.utils.remote import METRICS, ROWS, remote
from megarl.workers.base import EngineRole, build_engine


def critic_loss(cfg: ValueLossConfig, loss_agg_mode: str = "token-mean"):
    """loss_fn(outputs, micro_batch) of the critic (clipped value loss)."""

    def loss_fn(outputs: dict, mb: MicroBatch):
        rows, dev = mb.batch, outputs["values"].device
        inputs = ValueLossInputs(
            outputs["values"], rows["values"].to(dev), rows["returns"].to(dev), rows["response_mask"].to(dev)
        )
        return value_loss(inputs, cfg, aggregation(mb, loss_agg_mode))

    return loss_fn


class Critic(EngineRole):
    """The value model: V(s_t) per response token, clipped value-loss updates."""

    name = "critic"

    def __init__(
        self,
        engine,
        loss: ValueLossConfig = ValueLossConfig(),
        loss_agg_mode: str = "token-mean",
        offload: bool = False,
    ):
        super().__init__(engine, offload)
        self.head = ValueHead()
        self.loss_fn = critic_loss(loss, loss_agg_mode)

    @classmethod
    def from_config(cls, cfg, first: bool = False) -> "Critic":
        engine = build_engine(cfg, "critic", first=first, value_head=True, hf_path=cfg.critic.hf_path)
        critic = cls(engine, cfg.algorithm.value_loss, cfg.algorithm.loss_agg_mode, cfg.critic.offload)
        critic.publish()
        return critic

    @remote(ROWS)
    def compute_values(self, batch: Batch) -> Batch:
        """values [B, T]: V(s_t) before each response token."""
        return Batch.from_dict({"values": self.engine.forward(batch, self.head)["values"]})

    @remote(METRICS)
    def update(self, batch: Batch) -> dict:
        """One optimizer step of the value loss on the batch's rows."""
        return self.engine.train_step(batch, self.head, self.loss_fn)
