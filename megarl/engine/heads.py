"""Heads: a model's output turned into per-token tensors of the response (what roles compute).

Owns the three heads the roles hand to `MegatronEngine.forward` / `train_step`:

    LogProbHead  logits shard [b, S, V/tp] -> log pi(token) and entropy over response columns [b, T]
    ValueHead    scalar output [b, S, 1]   -> V(s_t) for response columns [b, T]
    ScoreHead    scalar output [b, S, 1]   -> the score at each row's last response token [b]

and `aggregation(mb, mode)`, the step's global loss denominators for a micro-batch.

Context parallelism: a head gets this CP rank's columns of the model output, computes per-token
values on them and gathers them into the full [b, S] frame (`MicroBatch.gather_cp`) before picking
response columns, so every CP rank returns the cp=1 rows and computes the same loss; the gather's
backward keeps only this rank's columns (see `megarl.engine.context`).
Must not import vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.algorithms import LossAggregation
from megarl.engine.logprobs import vocab_parallel_logprobs
from megarl.engine.micro import MicroBatch


@dataclass
class LogProbHead:
    """Logits shard [b, S, V/tp] → log π(token) and entropy over response columns [b, T]."""

    tp_group: object
    vocab_size: int
    temperature: float = 1.0
    chunk_tokens: int = 1024

    @classmethod
    def of(cls, engine, temperature: float = 1.0) -> "LogProbHead":
        """The head of an engine's model (its TP group, real vocabulary, log-prob chunking)."""
        return cls(engine.tp_group, engine.vocab_size, temperature, engine.config.logprob_chunk_tokens)

    def __call__(self, output: torch.Tensor, mb: MicroBatch) -> dict:
        targets = mb.local_targets().to(output.device)  # this CP rank's positions (all of them at cp=1)
        log_probs, entropy = vocab_parallel_logprobs(
            output,
            targets,
            tp_group=self.tp_group,
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            chunk_tokens=self.chunk_tokens,
        )
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


def aggregation(mb: MicroBatch, mode: str, max_response_len: Optional[int] = None) -> LossAggregation:
    """The step's global denominators (put in the batch meta by the engine) for `mode`."""
    meta = mb.batch.meta
    return LossAggregation(mode, meta.get("global_tokens"), meta.get("global_seqs"), max_response_len)
