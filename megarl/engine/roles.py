"""The four model roles, each an engine plus a head (and, when it trains, a loss): no role flags.

Owns: the heads (`LogProbHead`, `ValueHead`, `ScoreHead`: model output → per-token tensors),
the loss functions built from `megarl.algorithms` (`actor_loss`, `critic_loss`), and the roles

    Actor      log-probs + entropy; update with policy loss + KL loss + entropy bonus
    Reference  log-probs of a frozen policy (no optimizer; may share the actor's processes)
    Critic     values (scalar head); update with the clipped value loss
    RewardModel  scalar score at each row's last response token (no optimizer)

Batch columns read: input_ids, attention_mask [B, L]; response_mask [B, T] (the response is the
last T columns); the actor's update also old_log_probs, advantages (+ ref_log_probs with a KL
loss); the critic's values (old), returns. Must not import vLLM or Ray.

Context parallelism: a head gets this CP rank's columns of the model output, computes per-token
values on them and gathers them into the full [b, S] frame (`MicroBatch.gather_cp`) before
picking response columns, so every CP rank returns the cp=1 rows and computes the same loss; the
gather's backward keeps only this rank's columns (see `megarl.engine.context`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megarl.algorithms import (
    KLConfig, LossAggregation, PolicyLossConfig, PolicyLossInputs, ValueLossConfig, ValueLossInputs,
    entropy_bonus, get_policy_loss, kl_loss, value_loss,
)
from megarl.data.batch import Batch
from megarl.engine.engine import MegatronEngine
from megarl.engine.logprobs import vocab_parallel_logprobs
from megarl.engine.micro import MicroBatch


# ----------------------------------------------------------------------------- heads


@dataclass
class LogProbHead:
    """Logits shard [b, S, V/tp] → log π(token) and entropy over response columns [b, T]."""

    tp_group: object
    vocab_size: int
    temperature: float = 1.0
    chunk_tokens: int = 1024

    def __call__(self, output: torch.Tensor, mb: MicroBatch) -> dict:
        targets = mb.local_targets().to(output.device)  # this CP rank's positions (all of them at cp=1)
        log_probs, entropy = vocab_parallel_logprobs(output, targets, tp_group=self.tp_group, vocab_size=self.vocab_size,
                                                     temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        return {"log_probs": mb.to_response(mb.gather_cp(log_probs)), "entropy": mb.to_response(mb.gather_cp(entropy))}


class ValueHead:
    """Scalar head output [b, S, 1] → V(s_t) for response columns [b, T] (the state before token t)."""

    def __call__(self, output: torch.Tensor, mb: MicroBatch) -> dict:
        return {"values": mb.to_response(mb.gather_cp(output[..., 0].float()))}


class ScoreHead:
    """Scalar head output [b, S, 1] → the score at each row's last response token [b]."""

    def __call__(self, output: torch.Tensor, mb: MicroBatch) -> dict:
        at_token = mb.to_response(mb.gather_cp(output[..., 0].float()), shift=0)
        mask = mb.batch["response_mask"].to(at_token.device)
        last = (mask.long() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)
        return {"scores": at_token.gather(1, last.unsqueeze(1)).squeeze(1)}


def _head_for(engine: MegatronEngine, temperature: float) -> LogProbHead:
    return LogProbHead(engine.tp_group, engine.vocab_size, temperature, engine.config.logprob_chunk_tokens)


def aggregation(mb: MicroBatch, mode: str, max_response_len: Optional[int] = None) -> LossAggregation:
    """The step's global denominators (put in the batch meta by the engine) for `mode`."""
    meta = mb.batch.meta
    return LossAggregation(mode, meta.get("global_tokens"), meta.get("global_seqs"), max_response_len)


# ----------------------------------------------------------------------------- losses


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


def actor_loss(cfg: ActorLossConfig):
    """loss_fn(outputs, micro_batch) of the actor."""
    policy_loss = get_policy_loss(cfg.policy_loss.name)

    def loss_fn(outputs: dict, mb: MicroBatch):
        rows, agg = mb.batch, aggregation(mb, cfg.loss_agg_mode, cfg.max_response_len)
        dev = outputs["log_probs"].device
        mask = rows["response_mask"].to(dev)
        inputs = PolicyLossInputs(outputs["log_probs"], rows["old_log_probs"].to(dev), rows["advantages"].to(dev),
                                  mask, rows["is_weights"].to(dev) if "is_weights" in rows else None)
        loss, stats = policy_loss(inputs, cfg.policy_loss, agg)
        if cfg.kl.coef:
            kl, kl_stats = kl_loss(outputs["log_probs"], rows["ref_log_probs"].to(dev), mask, agg, cfg.kl.coef,
                                   cfg.kl.estimator)
            loss, stats = loss + kl, {**stats, **kl_stats}
        bonus, ent_stats = entropy_bonus(outputs["entropy"], mask, agg, cfg.entropy_coef)
        return loss + bonus if cfg.entropy_coef else loss, {**stats, **ent_stats}

    return loss_fn


def critic_loss(cfg: ValueLossConfig, loss_agg_mode: str = "token-mean"):
    """loss_fn(outputs, micro_batch) of the critic (clipped value loss)."""

    def loss_fn(outputs: dict, mb: MicroBatch):
        rows, dev = mb.batch, outputs["values"].device
        inputs = ValueLossInputs(outputs["values"], rows["values"].to(dev), rows["returns"].to(dev),
                                 rows["response_mask"].to(dev))
        return value_loss(inputs, cfg, aggregation(mb, loss_agg_mode))

    return loss_fn


# ----------------------------------------------------------------------------- roles


class Actor:
    """The policy: log-probs and entropy, and PPO/GRPO updates."""

    def __init__(self, engine: MegatronEngine, loss: ActorLossConfig = ActorLossConfig()):
        self.engine, self.loss_config = engine, loss
        self.head = _head_for(engine, loss.temperature)
        self.loss_fn = actor_loss(loss)

    def compute_log_probs(self, batch: Batch) -> dict:
        """{"log_probs", "entropy"}: [B, T] for this rank's rows."""
        return self.engine.forward(batch, self.head)

    def update(self, batch: Batch) -> dict:
        return self.engine.train_step(batch, self.head, self.loss_fn)


class Reference:
    """A frozen policy: log-probs only (its engine has no optimizer)."""

    def __init__(self, engine: MegatronEngine, temperature: float = 1.0):
        self.engine, self.head = engine, _head_for(engine, temperature)

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        return self.engine.forward(batch, self.head)["log_probs"]


class Critic:
    """The value model: V(s_t) per response token, clipped value-loss updates."""

    def __init__(self, engine: MegatronEngine, loss: ValueLossConfig = ValueLossConfig(),
                 loss_agg_mode: str = "token-mean"):
        self.engine, self.head = engine, ValueHead()
        self.loss_fn = critic_loss(loss, loss_agg_mode)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.engine.forward(batch, self.head)["values"]

    def update(self, batch: Batch) -> dict:
        return self.engine.train_step(batch, self.head, self.loss_fn)


class RewardModel:
    """A scalar-head model scoring each row at its last response token."""

    def __init__(self, engine: MegatronEngine):
        self.engine, self.head = engine, ScoreHead()

    def compute_scores(self, batch: Batch) -> torch.Tensor:
        return self.engine.forward(batch, self.head)["scores"]
