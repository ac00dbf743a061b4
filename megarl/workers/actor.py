"""The actor role: the policy being trained.

Owns `Actor` (its engine, the log-prob head at the rollout temperature, the actor objective) and
the objective itself: `ActorLossConfig` and `actor_loss` (policy loss + β·KL(π‖π_ref) − c·entropy,
one aggregation mode, global denominators).

Reads (batch columns): input_ids, attention_mask, response_mask; for the update also
old_log_probs (absent: the step's only update takes them from its own forward), advantages
(+ ref_log_probs with a KL loss, is_weights when mismatch correction is on, rollout_log_probs: the
behaviour policy of decoupled_ppo). Writes: old_log_probs, entropy.
Must not import vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.algorithms import (
    KLConfig,
    PolicyLossConfig,
    PolicyLossInputs,
    entropy_bonus,
    get_policy_loss,
    kl_loss,
    mismatch_metrics,
)
from megarl.data.batch import Batch
from megarl.engine.heads import LogProbHead, aggregation
from megarl.engine.micro import MicroBatch
from megarl.utils.remote import METRICS, ROWS, remote
from megarl.workers.base import EngineRole, build_engine


@dataclass
class ActorLossConfig:
    """The actor's objective: policy loss + β·KL(π‖π_ref) − c·entropy, one aggregation mode."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss and its clipping."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL loss towards the reference (coef 0: off; needs ref_log_probs)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0: off)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation mode (see megarl.algorithms.aggregation)."""
    max_response_len: Optional[int] = None
    """Needed by seq-mean-token-sum-norm."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are taken at."""

    @classmethod
    def from_run_config(cls, cfg) -> "ActorLossConfig":
        alg = cfg.algorithm
        return cls(
            policy_loss=alg.policy_loss,
            kl=alg.kl_loss,
            entropy_coef=alg.entropy_coef,
            loss_agg_mode=alg.loss_agg_mode,
            max_response_len=cfg.rollout.max_response_tokens,
            temperature=cfg.rollout.temperature or 1.0,
        )


def actor_loss(cfg: ActorLossConfig):
    """loss_fn(outputs, micro_batch) of the actor."""
    policy_loss = get_policy_loss(cfg.policy_loss.name)

    def loss_fn(outputs: dict, mb: MicroBatch):
        rows, agg = mb.batch, aggregation(mb, cfg.loss_agg_mode, cfg.max_response_len)
        dev = outputs["log_probs"].device
        mask = rows["response_mask"].to(dev)
        # without old_log_probs the update is the step's only one (`RLTrainer.skips_old_log_probs`): the
        # policy before it is the current one, so its log-probs are this forward's, detached
        on_policy = "old_log_probs" not in rows
        old = outputs["log_probs"].detach() if on_policy else rows["old_log_probs"].to(dev)
        inputs = PolicyLossInputs(
            outputs["log_probs"],
            old,
            rows["advantages"].to(dev),
            mask,
            _optional(rows, "is_weights", dev),
            _optional(rows, "rollout_log_probs", dev),
        )
        loss, stats = policy_loss(inputs, cfg.policy_loss, agg)
        if cfg.kl.coef:
            kl, kl_stats = kl_loss(
                outputs["log_probs"], rows["ref_log_probs"].to(dev), mask, agg, cfg.kl.coef, cfg.kl.estimator
            )
            loss, stats = loss + kl, {**stats, **kl_stats}
        bonus, ent_stats = entropy_bonus(outputs["entropy"], mask, agg, cfg.entropy_coef)
        gap = {}
        if on_policy and "rollout_log_probs" in rows:  # the trainer/engine gap, from this forward
            gap = {f"rollout_{k}": v for k, v in mismatch_metrics(old, rows["rollout_log_probs"].to(dev), mask).items()}
        return loss + bonus if cfg.entropy_coef else loss, {**stats, **ent_stats, **gap}

    return loss_fn


def _optional(rows, key: str, device):
    return rows[key].to(device) if key in rows else None


class Actor(EngineRole):
    """The policy: log-probs and entropy of sampled responses, and PPO/GRPO updates."""

    name = "actor"

    def __init__(self, engine, loss: ActorLossConfig = ActorLossConfig(), offload: bool = False):
        super().__init__(engine, offload)
        self.loss_config = loss
        self.head = LogProbHead.of(engine, loss.temperature)
        self.loss_fn = actor_loss(loss)

    @classmethod
    def from_config(cls, cfg, first: bool = True) -> "Actor":
        """The run's actor, built in a worker process (collective over the world)."""
        actor = cls(build_engine(cfg, "actor", first=first), ActorLossConfig.from_run_config(cfg), cfg.actor.offload)
        actor.publish()
        return actor

    @remote(ROWS)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """old_log_probs and entropy [B, T] of the batch's responses under the current policy."""
        out = self.engine.forward(batch, self.head)
        return Batch.from_dict({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @remote(METRICS)
    def update(self, batch: Batch) -> dict:
        """One optimizer step on the batch's rows; loss, grad norm, lr and the loss's statistics."""
        return self.engine.train_step(batch, self.head, self.loss_fn)
