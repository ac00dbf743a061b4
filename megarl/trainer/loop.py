"""The RL loop, in one place: PPO and GRPO (and their variants) differ only by configuration.

    step = generate → score → shape → old log-probs → ref log-probs → values → advantages
           → critic update → actor update → weight sync          (each phase timed)

Which phases do work follows from the active roles (`megarl.config.active_roles`): without a
reference the ref phase is empty, without a critic the value phase and critic update are, and
the advantage estimator is looked up by name (its declared needs say whether the step also
generates greedy baselines, for ReMax). Colocated engines sleep through the training phases.
Rewards scored off the driver's thread (the reward pool, or a batch-level reward fn) are scored
while the log-prob phases run (`overlaps_rewards`). Validation (greedy by default, or its own
sampling) runs before the first step and every `validation.every_steps`; `trainer.val_only` only
validates. Checkpoints every `trainer.checkpoint_every_steps` and at the end (`trainer.checkpoint_async`:
written while the next step runs, counted from its training phases on); `trainer.resume=auto`
continues from the latest complete checkpoint. `train_step` = `rollout` + `learn` (the training
phases, which the asynchronous driver, `megarl.trainer.async_loop`, reuses on batches from its buffer).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from megarl.algorithms import (
    AdvantageInputs,
    apply_kl_penalty,
    estimator_needs,
    get_advantage_estimator,
    make_kl_controller,
)
from megarl.algorithms.dapo import dynamic_sample, mask_truncated, overlong_penalty
from megarl.algorithms.mismatch import truncated_is_weights
from megarl.data.batch import Batch
from megarl.rollout.base import SamplingParams
from megarl.trainer import batching, state
from megarl.trainer.agents import AgentRollout, agent_metrics
from megarl.trainer.metrics import (
    PhaseTimer,
    RunLogger,
    ZeroVarianceWatch,
    batch_metrics,
    mean_metrics,
    mfu_meter,
    timing_metrics,
    validation_metrics,
)
from megarl.utils.faults import hold

VAL_AGENT_METRICS = ("agent/tool_success", "agent/tool_calls", "agent/tool_errors", "agent/turns")
"""Agent metrics also logged for validation (as val/agent/...) when the loops report them."""


class RLTrainer:
    """Drives the roles of a `megarl.controller.Cluster` through the RL loop of a `RunConfig`."""

    def __init__(self, cfg, derived, cluster, data):
        self.cfg, self.derived, self.cluster, self.data = cfg, derived, cluster, data
        self.parts = PhaseTimer()  # seconds per part of `fit`: steps, validation, checkpoints, export, plot
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_reward)
        self.mfu = mfu_meter(cfg, derived)
        ro = cfg.rollout
        self.sampling = SamplingParams(
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            max_tokens=ro.max_response_tokens,
            n=ro.samples_per_prompt,
            stop_token_ids=data.stop_token_ids,
        )
        self.greedy = replace(self.sampling, n=1, temperature=0.0)
        self.validation_params = validation_sampling(cfg, self.sampling)
        self.needs_baseline = "baseline_rewards" in estimator_needs(cfg.algorithm.advantage.estimator)
        self.agents = AgentRollout(data.agents, cluster.rollout)
        self.zero_variance = ZeroVarianceWatch(cfg.trainer.zero_variance_warn_steps)
        self.reward_thread = ThreadPoolExecutor(1, "megarl-reward") if self.overlaps_rewards() else None
        self.step = 0
        self.resumed_state: Optional[state.DriverState] = None
        self.pending_checkpoint: Optional[tuple[Path, state.DriverState]] = None  # (directory, its driver state)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict]:
        """Run (or continue) the configured steps; the metrics of each step run here."""
        tr, val = self.cfg.trainer, self.cfg.validation
        self.step = self.resume()
        if tr.val_only:
            return self.validate_only()
        self.log = RunLogger(self.cfg, start_step=self.step)
        history, parts = [], self.parts
        try:
            if self.step == 0 and val.before_train:
                with parts("validation"):
                    self.log.log(0, self.validate(), advance=False)
            while self.step < tr.total_steps:
                self.step += 1
                with parts("steps"):
                    metrics = self.train_step(self.step)
                if _every(self.step, val.every_steps, tr.total_steps):
                    with parts("validation"):
                        metrics.update(self.validate())
                self.log.log(self.step, metrics)
                self.warn(self.zero_variance.update(metrics))
                history.append(metrics)
                if _every(self.step, tr.checkpoint_every_steps, tr.total_steps):
                    with parts("checkpoints"):
                        self.save_checkpoint(self.step)
            self.finish()
        finally:
            self.log.close()
            if self.reward_thread is not None:
                self.reward_thread.shutdown(wait=False, cancel_futures=True)
        return history

    def validate_only(self) -> list[dict]:
        """trainer.val_only: validate the loaded policy once, append it to metrics.jsonl at its step, exit."""
        self.log = RunLogger(self.cfg, start_step=self.step, append_only=True)
        try:
            metrics = self.validate()
            self.log.log(self.step, metrics, advance=False)
        finally:
            self.log.close()
        return [metrics]

    def warn(self, message: Optional[str]) -> None:
        if message:
            self.log.print(message)

    def train_step(self, step: int) -> dict:
        """One RL step; returns its metrics."""
        timer = PhaseTimer()
        batch, stats, scoring = self.rollout(step, timer)  # generate → score → shape
        return self.learn(step, batch, stats, timer, scoring)

    def learn(self, step: int, batch: Batch, stats: dict, timer: PhaseTimer, scoring: Optional[Future] = None) -> dict:
        """The training phases of a step on its samples (also the async driver's): the step's metrics.
        `scoring`: the future of rewards still being scored (`overlaps_rewards`), joined after the log-probs."""
        cluster = self.cluster
        self.complete_checkpoint(wait=False)  # an asynchronous checkpoint written since the last step counts now
        on_policy = self.skips_old_log_probs(step, batch)
        with cluster.rollout.asleep(timer):  # colocated engines free their memory
            if not on_policy:
                with timer("old_log_probs"):
                    batch = batch.union(cluster.actor.compute_log_probs(batch))
            if cluster.ref:
                with timer("ref_log_probs"):
                    batch = batch.union(cluster.ref.compute_log_probs(batch))
            if cluster.critic:
                with timer("values"):
                    batch = batch.union(cluster.critic.compute_values(batch))
            if scoring is not None:  # rewards scored meanwhile: wait for the rest
                with timer("reward"):
                    batch = self.shape(self.score(batch, scoring.result()))
            with timer("advantages"):
                batch = self.advantages(batch, stats)
            if cluster.critic:
                with timer("critic_update"):
                    stats.update(self.update("critic", batch))
            hold("step.actor_update")  # fault injection: mid-step
            if self.actor_trains(step):
                with timer("actor_update"):
                    stats.update(_gap_metrics(self.update("actor", batch)))
        if self.actor_trains(step):  # critic warm-up: engines keep their weights
            with timer("weight_sync"):
                stats["rollout/policy_version"] = float(self.push_weights())
        self.dump_rollouts(step, batch)
        return {**batch_metrics(batch), **stats, **timing_metrics(timer, batch, self.mfu)}

    def skips_old_log_probs(self, step: int, batch: Batch) -> bool:
        """The step's actor update is its only one and nothing else reads the old log-probs: the policy
        before that update is the current one, so the update takes them from its own forward (detached)
        instead of a separate forward pass (sync mode, one mini-batch, one epoch, no KL-in-reward, no
        rollout/train importance correction)."""
        cfg, alg = self.cfg, self.cfg.algorithm
        return (
            cfg.trainer.mode == "sync"
            and self.actor_trains(step)
            and self.derived.updates_per_step["actor"] == 1
            and len(batch) <= self.derived.samples_per_update["actor"]
            and alg.kl_reward.coef == 0
            and alg.mismatch.level is None
        )

    def push_weights(self) -> int:
        """The actor's weights into the engines; their new policy version."""
        return self.cluster.rollout.sync_weights()

    def actor_trains(self, step: int) -> bool:
        """False during the critic warm-up (`algorithm.critic_warmup_steps`)."""
        return step > self.cfg.algorithm.critic_warmup_steps

    # ------------------------------------------------------------------ phases

    def overlaps_rewards(self) -> bool:
        """Rewards scored off the driver's thread (the reward worker pool, or a batch reward fn) run while the
        log-prob phases run, unless the step needs its scores first (dynamic sampling, ReMax's baseline)."""
        rw = self.cfg.reward
        off_thread = rw.num_workers > 0 or rw.batch_reward_fn is not None
        return off_thread and not self.cfg.algorithm.dapo.filter_groups and not self.needs_baseline

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[Batch, dict, Optional[Future]]:
        """The step's samples, scored (generate → score → shape), or when rewards overlap the log-prob
        phases (`overlaps_rewards`) unscored with the future of their rule rewards; with DAPO dynamic
        sampling (`algorithm.dapo.filter_groups`) rounds until `prompts_per_step` groups have reward variance."""
        rounds, scores, stats = itertools.count(), [], {}
        if self.reward_thread is not None:
            with timer("generate"):
                batch = self.generate(self.data.loader.next_batch(), step, stats=stats)
            batch["response_text"] = batching.decode_responses(batch, self.data.tokenizer)
            return batch, stats, self.reward_thread.submit(self.rule_rewards, batch)

        def one_round() -> Batch:
            prompts, round_ = self.data.loader.next_batch(), next(rounds)
            with timer("generate"):
                batch = self.generate(prompts, step, round_=round_, stats=stats)
            with timer("reward"):
                batch = self.score(batch)
                batch = self.shape(batch)
            if self.needs_baseline:
                batch["baseline_rewards"] = self.baseline_scores(prompts, step, timer)
            scores.append(batch["scores"])
            return batch

        dapo = self.cfg.algorithm.dapo
        if not dapo.filter_groups:
            return one_round(), stats, None
        batch, n = dynamic_sample(
            one_round, self.cfg.trainer.prompts_per_step, dapo.max_generations, score_key="scores"
        )
        # reward/* metrics describe the kept groups; these describe everything generated
        return (
            batch,
            {
                **stats,
                "rollout/generation_rounds": float(n),
                "rollout/score_before_filter": float(torch.cat(scores).mean()),
            },
            None,
        )

    def generate(
        self,
        prompts: Batch,
        step: int,
        params: Optional[SamplingParams] = None,
        round_: int = 0,
        stats: Optional[dict] = None,
    ) -> Batch:
        """A trajectory per sample of every prompt, from its row's agent loop over the rollout engines, as
        the training batch (group ids `step.round:row` stay unique across the rounds of a step); the agent
        metrics (turns, tool calls and errors, ...) go into `stats`."""
        params = params or self.sampling
        seed = step_seed(self.cfg.trainer.seed, step, round_)
        start = time.perf_counter()
        trajectories = self.agents.run(prompts, params, seed, session=f"{step}.{round_}")
        if stats is not None:
            stats.update(agent_metrics([t for group in trajectories for t in group], time.perf_counter() - start))
        return batching.trajectory_batch(
            prompts, trajectories, self.data.pad_token_id, group_prefix=f"{step}.{round_}:"
        )

    def rule_rewards(self, batch: Batch) -> list[dict]:
        """The reward fns' results (one dict per row: score, acc, ...) for the rows' `response_text`."""
        extras = [
            {**(e if isinstance(e, dict) else {}), **(r or {})}
            for e, r in zip(_column(batch, "extra_info", len(batch)), _column(batch, "reward_extras", len(batch)))
        ]
        return self.data.rewards.score(
            list(batch["response_text"]), list(batch["ground_truth"]), list(batch["data_source"]), extras
        )

    def score(self, batch: Batch, results: Optional[list[dict]] = None) -> Batch:
        """Rule rewards (scored now unless `results` are given) + the reward model's score → scores, acc,
        reward_info (the fns' other entries) and the response texts they read."""
        if "response_text" not in batch:
            batch["response_text"] = batching.decode_responses(batch, self.data.tokenizer)
        results = self.rule_rewards(batch) if results is None else results
        scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
        if self.cluster.reward_model:
            batch = batch.union(self.cluster.reward_model.compute_scores(batch))
            scores = scores + self.cfg.reward_model.weight * batch["rm_scores"].float()
        batch["scores"] = scores
        batch["acc"] = torch.tensor([float(r.get("acc", r["score"] > 0)) for r in results])
        batch["reward_info"] = [{k: v for k, v in r.items() if k not in ("score", "acc")} for r in results]
        return batch

    def shape(self, batch: Batch) -> Batch:
        """DAPO overlong shaping (penalty zone, masking truncated responses) where configured, then the
        score placed on each row's last model token plus the per-turn rewards (`token_level_scores`)."""
        dapo, lengths = self.cfg.algorithm.dapo, batch["response_mask"].sum(-1)
        if dapo.overlong_buffer_len:
            batch["scores"] = batch["scores"] + overlong_penalty(
                lengths, self.cfg.rollout.max_response_tokens, dapo.overlong_buffer_len, dapo.overlong_penalty_factor
            )
        if dapo.overlong_filter:
            truncated = torch.from_numpy((batch["finish_reason"] == "length").astype(bool))
            batch["response_mask"] = mask_truncated(batch["response_mask"], truncated)
        outcome = batching.outcome_rewards(batch["scores"], batch["response_mask"])
        batch["token_level_scores"] = outcome + batch["turn_rewards"] if "turn_rewards" in batch else outcome
        return batch

    def baseline_scores(self, prompts: Batch, step: int, timer: PhaseTimer) -> torch.Tensor:
        """ReMax's baseline: the score of each prompt's greedy response, repeated over its samples [B]."""
        with timer("generate"):
            greedy = self.generate(prompts, step, self.greedy)
        with timer("reward"):
            scores = self.score(greedy)["scores"]
        return scores.repeat_interleave(self.sampling.n)

    def advantages(self, batch: Batch, stats: dict) -> Batch:
        """KL-in-reward (if on), the configured estimator, and rollout/train importance weights (if on)."""
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        rewards = batch["token_level_scores"]
        if alg.kl_reward.coef > 0:
            rewards, kl = apply_kl_penalty(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                mask,
                self.kl_ctrl.value,
                alg.kl_reward.estimator,
            )
            self.kl_ctrl.update(float(kl["kl"]), len(batch))
            stats.update({"actor/reward_kl": float(kl["kl"]), "actor/kl_coef": float(kl["kl_coef"])})
        inputs = AdvantageInputs(
            rewards,
            mask,
            values=_optional(batch, "values"),
            group_ids=list(batch["uid"]),
            baseline_rewards=_optional(batch, "baseline_rewards"),
        )
        batch["advantages"], batch["returns"] = get_advantage_estimator(alg.advantage.estimator)(inputs, alg.advantage)
        batch["token_level_rewards"] = rewards
        if alg.mismatch.level is not None:
            batch["is_weights"], is_stats = truncated_is_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], mask, alg.mismatch.cap, alg.mismatch.level
            )
            stats.update({f"rollout/{k}": float(v) for k, v in is_stats.items()})
        return batch

    def update(self, role: str, batch: Batch) -> dict:
        """The role's optimizer steps over the step's samples (mini-batches × epochs); mean metrics."""
        rows = self.derived.samples_per_update[role]
        parts = batching.minibatches(batch, rows, getattr(self.cfg, role).epochs_per_step)
        handle = getattr(self.cluster, role)
        return mean_metrics([handle.update(part) for part in parts], role)

    # ------------------------------------------------------------------ validation, checkpoints

    def validate(self) -> dict:
        """Mean score / accuracy of the validation prompts (greedy unless validation.greedy=false)."""
        if self.data.validation is None:
            return {}
        stats: dict = {}
        batch = self.score(self.generate(self.data.validation, step=-1, params=self.validation_params, stats=stats))
        return {
            **validation_metrics(batch, self.validation_params.n),
            **{f"val/{key}": stats[key] for key in VAL_AGENT_METRICS if key in stats},
        }

    def dump_rollouts(self, step: int, batch: Batch) -> None:
        """Every `trainer.dump_rollouts_every_steps`: the step's samples to rollouts/step_N.jsonl."""
        if _every(step, self.cfg.trainer.dump_rollouts_every_steps, self.cfg.trainer.total_steps):
            self.log.dump_rollouts(step, rollout_records(batch))

    def save_checkpoint(self, step: int) -> None:
        """Every trainable role's engine checkpoint, then the driver state (which marks it complete).
        With `trainer.checkpoint_async` the engines' files are still being written when this returns:
        `complete_checkpoint` writes the driver state once they are."""
        self.complete_checkpoint(wait=True)  # one checkpoint in flight at a time
        tr = self.cfg.trainer
        directory, wait = state.step_dir(tr.run_dir, step), not tr.checkpoint_async
        for name, role in self.cluster.trainable_roles().items():
            role.save_checkpoint(str(directory / name), wait, tr.checkpoint_reshardable)
        self.pending_checkpoint = (directory, self.driver_state(step))
        if wait:
            self._checkpoint_written()

    def complete_checkpoint(self, wait: bool) -> None:
        """Count the checkpoint being written, if any, once every role has published its engines' part
        (`wait`: wait until they have)."""
        if self.pending_checkpoint is not None:
            finished = [role.finish_checkpoint(wait) for role in self.cluster.trainable_roles().values()]
            if all(finished):
                self._checkpoint_written()

    def _checkpoint_written(self) -> None:
        """The engines' part of the pending checkpoint is published: its driver state, then older ones pruned."""
        directory, driver_state = self.pending_checkpoint
        self.pending_checkpoint = None
        state.save_driver_state(directory, driver_state)
        state.prune_checkpoints(self.cfg.trainer.run_dir, self.cfg.trainer.keep_checkpoints)

    def driver_state(self, step: int) -> state.DriverState:
        """What the driver saves beside the engines' checkpoints after `step`."""
        kl = self.kl_ctrl.value if self.cfg.algorithm.kl_reward.coef > 0 else None
        return state.DriverState(step, self.data.loader.state_dict(), kl, state.rng_state())

    def resume(self) -> int:
        """Continue from the checkpoint trainer.resume points at, if any (a damaged one falls back to the
        previous intact one: `state.resume_from`); the step resumed at."""
        return state.resume_from(self.cfg.trainer.resume, self.cfg.trainer.run_dir, self.load_checkpoint)

    def load_checkpoint(self, directory: Path) -> int:
        """Load a checkpoint into the workers and the driver and push its weights to the engines."""
        for name, role in self.cluster.trainable_roles().items():
            role.load_checkpoint(str(directory / name))
        saved = state.load_driver_state(directory)
        self.data.loader.load_state_dict(saved.loader)
        if saved.kl_coef is not None:
            self.kl_ctrl.value = saved.kl_coef
        state.set_rng_state(saved.rng)
        self.resumed_state = saved
        self.cluster.rollout.sync_weights()
        print(f"[megarl] resumed from {directory} (step {saved.step})", flush=True)
        return saved.step

    def finish(self) -> None:
        """The last checkpoint completed, the final HF export and the reward plot."""
        with self.parts("checkpoints"):
            self.complete_checkpoint(wait=True)
        if self.cfg.trainer.export_hf_at_end:
            with self.parts("export"):
                self.cluster.actor.export_hf(str(Path(self.cfg.trainer.run_dir) / "hf"))
        self.log.print(f"[megarl] {self.log.summary()}")
        with self.parts("plot"):
            plot = self.log.plot()
        if plot is not None:
            self.log.print(f"[megarl] reward curve: {plot}")
        self.log.print(f"[megarl] time in the loop: {time_summary(self.parts.seconds)}")


def _gap_metrics(stats: dict) -> dict:
    """An update that took the old log-probs from its own forward reports the rollout/train log-prob gap
    (`actor/rollout_mismatch_*`): under the name `batch_metrics` gives it otherwise (`rollout/mismatch_*`)."""
    prefix = "actor/rollout_mismatch_"
    return {(f"rollout/mismatch_{k[len(prefix) :]}" if k.startswith(prefix) else k): v for k, v in stats.items()}


def time_summary(seconds: dict[str, float]) -> str:
    """Seconds of each part of `fit` in the order they first ran: "steps 56.1 s, validation 3.2 s, ..."."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()) or "nothing ran"


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of a step's generation round; sample `i` of prompt row `r` gets seed + r + i."""
    return (seed * 1_000_003 + step * 10_007 + round_ * 101) % (2**31)


def validation_sampling(cfg, sampling: SamplingParams) -> SamplingParams:
    """Validation's own sampling: greedy, or validation.temperature / top_p / top_k (None: the rollout's),
    validation.samples_per_prompt responses per prompt."""
    val = cfg.validation
    if val.greedy:
        return replace(sampling, n=val.samples_per_prompt, temperature=0.0, top_p=1.0, top_k=0)
    return replace(
        sampling,
        n=val.samples_per_prompt,
        **{k: getattr(val, k) for k in ("temperature", "top_p", "top_k") if getattr(val, k) is not None},
    )


def _every(step: int, every: int, total: int) -> bool:
    """Periodic events: every `every` steps (0: never) and at the last step."""
    return step == total or (every > 0 and step % every == 0)


def _column(batch: Batch, key: str, rows: int) -> list:
    return list(batch[key]) if key in batch else [None] * rows


def _optional(batch: Batch, key: str) -> Optional[torch.Tensor]:
    return batch[key] if key in batch else None


def rollout_records(batch: Batch) -> list[dict]:
    """One JSON-able record per sample: prompt, response, score, mean advantage over its tokens,
    finish reason, policy version (and the greedy baseline's score under ReMax)."""
    adv = batch["advantages"].sum(-1) / batch["response_mask"].sum(-1).clamp(min=1)
    baseline = _optional(batch, "baseline_rewards")
    return [
        {
            "uid": batch["uid"][i],
            "prompt": batch["raw_prompt"][i] if "raw_prompt" in batch else None,
            "response": batch["response_text"][i],
            "ground_truth": batch["ground_truth"][i],
            "score": float(batch["scores"][i]),
            "advantage": float(adv[i]),
            "finish_reason": batch["finish_reason"][i],
            "policy_version": int(batch["policy_version"][i]),
            **({"baseline_score": float(baseline[i])} if baseline is not None else {}),
            **({"turns": batch["agent_turns"][i]} if "agent_turns" in batch and batch["agent_turns"][i] else {}),
        }
        for i in range(len(batch))
    ]
