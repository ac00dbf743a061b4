"""The inputs of the schedule model: cluster layout, response lengths, decode speed, trainer costs, async knobs.

Owns the dataclasses a simulation is built from (`SimConfig` and its parts) and the length sampler.
Pure Python (no torch, numpy, Ray); imports nothing from megarl.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence


@dataclass
class Layout:
    """Where generation and training run."""

    rollout_gpus: int = 1
    """GPUs (or CPU worker slots) of the rollout engines."""
    train_gpus: int = 1
    """GPUs of the trainer (actor, reference, ...): only reported; their speed is in `Costs`."""
    engine_tp: int = 1
    """Tensor-parallel size of one engine: engines = rollout_gpus // engine_tp."""
    max_seqs_per_engine: int = 256
    """Sequences one engine decodes at once (vLLM max_num_seqs / KV-cache bound); the rest queue."""

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.engine_tp


@dataclass
class Lengths:
    """Response lengths in tokens: a lognormal clipped at `max_tokens`, or measured lengths resampled."""

    median: float = 1000.0
    """Median of the lognormal (tokens)."""
    sigma: float = 1.0
    """Log-space standard deviation: 0 = every response the median; ~1 = a long tail."""
    max_tokens: int = 8192
    """The cap (max_response_tokens): longer draws are clipped (finish_reason "length")."""
    measured: Optional[Sequence[int]] = None
    """Measured lengths: when set, draws resample these (with replacement) instead of the lognormal."""

    def draw(self, rng: random.Random) -> int:
        if self.measured:
            return max(1, min(self.max_tokens, int(rng.choice(self.measured))))
        return max(1, min(self.max_tokens, int(round(rng.lognormvariate(math.log(self.median), self.sigma)))))

    def mean(self, draws: int = 20000, seed: int = 0) -> float:
        rng = random.Random(seed)
        return sum(self.draw(rng) for _ in range(draws)) / draws


@dataclass
class Decode:
    """One engine's decode step: every running sequence gains a token in `base_s + per_seq_s * running` seconds
    (weights read once per step, KV cache and compute per sequence). A sequence's tokens/s is the inverse;
    the engine's is `running` times that."""

    base_s: float = 0.007
    """Seconds of a decode step independent of the batch (weight reads, launch)."""
    per_seq_s: float = 0.0001
    """Seconds each running sequence adds to a decode step."""

    def step_s(self, running: int) -> float:
        return self.base_s + self.per_seq_s * running


@dataclass
class Costs:
    """The trainer's side of a step."""

    train_s_per_sample: float = 0.01
    """Seconds of trainer work per sample: reward, log-probs, advantages, updates (all of a step but
    generation and weight sync, over the batch's samples)."""
    weight_sync_s: float = 1.0
    """Seconds of one weight update of the engines; the engines decode nothing meanwhile."""


@dataclass
class Async:
    """The asynchronous schedule's knobs (the names of the `async_training` config section)."""

    max_staleness: int = 1
    """Versions a trained sample may lag the trainer: admission capacity (version + 1 + max_staleness) * batch."""
    max_concurrent_rollouts: Optional[int] = None
    """Samples in flight at most (None: only the staleness capacity bounds admission)."""
    over_stale: str = "pace"
    """"pace": the trainer waits for samples that would otherwise go over-stale; "drop": they are dropped."""
    on_update: str = "continue"
    """"continue": in-flight requests go on with the new weights (keep their first version);
    "abort": they are aborted at a weight update and resubmitted (their tokens are lost)."""

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: must be >= 0 (0 = the synchronous schedule)")
        if self.over_stale not in ("pace", "drop"):
            raise ValueError(f"over_stale={self.over_stale!r}: choose 'pace' or 'drop'")
        if self.on_update not in ("continue", "abort"):
            raise ValueError(f"on_update={self.on_update!r}: choose 'continue' or 'abort'")


@dataclass
class SimConfig:
    """Everything one simulation needs."""

    layout: Layout = field(default_factory=Layout)
    lengths: Lengths = field(default_factory=Lengths)
    decode: Decode = field(default_factory=Decode)
    costs: Costs = field(default_factory=Costs)
    prompts_per_step: int = 8
    """Prompt groups the trainer takes per update."""
    samples_per_prompt: int = 8
    """Samples per group (GRPO's n): a group is ready when all of them are."""
    steps: int = 20
    """Updates simulated."""
    warmup_steps: int = 2
    """Leading updates left out of the throughput (the async pipeline filling up)."""
    seed: int = 0
    """Seed of the length draws (both schedules see the same groups)."""
    name: str = "custom"
    """Shown in the report."""

    def __post_init__(self):
        if self.layout.engines < 1:
            raise ValueError(
                f"layout: rollout_gpus={self.layout.rollout_gpus} < engine_tp={self.layout.engine_tp}: "
                "no engine fits; give the rollout at least engine_tp GPUs"
            )
        if self.steps <= self.warmup_steps:
            raise ValueError(f"steps={self.steps} must exceed warmup_steps={self.warmup_steps}")
        if min(self.prompts_per_step, self.samples_per_prompt, self.layout.max_seqs_per_engine) < 1:
            raise ValueError("prompts_per_step, samples_per_prompt and max_seqs_per_engine must be >= 1")

    @property
    def batch_samples(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def group_lengths(self, groups: int) -> list[list[int]]:
        """The response lengths of the first `groups` prompt groups, in admission order (seeded)."""
        rng = random.Random(self.seed)
        return [[self.lengths.draw(rng) for _ in range(self.samples_per_prompt)] for _ in range(groups)]

    def colocated(self) -> "SimConfig":
        """The synchronous baseline of colocated systems: every GPU (rollout + training) runs an engine while
        generating and trains while training (trainer time scaled by GPUs, linearly); same weight sync."""
        gpus = self.layout.rollout_gpus + self.layout.train_gpus
        layout = replace(self.layout, rollout_gpus=gpus, train_gpus=gpus)
        costs = replace(self.costs, train_s_per_sample=self.costs.train_s_per_sample * self.layout.train_gpus / gpus)
        return replace(self, layout=layout, costs=costs, name=f"{self.name}, colocated on all {gpus} GPUs")
