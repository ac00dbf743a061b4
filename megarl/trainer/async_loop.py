"""Asynchronous training (trainer.mode=async): rollouts stream into a buffer while the trainer trains.

Owns `AsyncRLTrainer` (an `RLTrainer` whose step takes its batch from the buffer and updates the
engines' weights with them paused, not drained; the phases are `RLTrainer.learn`'s) and `Producer` (an
asyncio loop on its own thread: it pulls prompt groups from the loader, admits them under the staleness
bound, runs each sample through its row's agent loop over `cluster.rollout.submit`, buffers finished groups).

    admit    a group (rollout.samples_per_prompt trajectories) may start while
             started - dropped + 1 <= (trained + 1 + max_staleness) * prompts_per_step   (AReaL's rule)
             and the trajectories in flight stay within async_training.max_concurrent_rollouts
    take     the next batch: prompts_per_step finished groups. over_stale=pace: it always holds every group
             admitted max_staleness or more steps ago (the trainer waits for them), so no trained token lags
             the trainer by more than max_staleness versions; drop: any finished groups, those whose oldest
             token is too stale dropped, counted and resubmitted
    update   pause(keep | abort) → sync weights → resume: in-flight requests continue on the new weights
             (on_update=continue; per-token versions show the switch) or rerun on them (abort: the router
             reruns what the engines aborted). A failed update stops the run naming the engines' version.
    resume   a checkpoint holds the loader position of the oldest loader batch not fully trained and the rows
             of later batches already trained (`Producer.state_dict`); the resumed run regenerates the others
             (buffered or in flight when it stopped) first, so every prompt is trained once.

Group (loader batch k, row r) is seeded and named as the synchronous step k seeds its row r (`step_seed`,
uid "k.0:r"), so max_staleness=0 trains exactly the synchronous run's batches. Groups are scored when the
trainer takes them (the reward runner and reward model are driven from the trainer's thread only); a
step's time/generate is the trainer's wait for finished groups.
Imports asyncio and threading; Ray only through the engines' handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from megarl.agent.trajectory import Trajectory
from megarl.data.batch import Batch
from megarl.trainer import batching
from megarl.trainer.agents import agent_metrics
from megarl.trainer.loop import RLTrainer, step_seed
from megarl.trainer.metrics import PhaseTimer

PAUSE_MODE = {"continue": "keep", "abort": "abort"}
"""async_training.on_update → the engines' pause mode around a weight update."""
_REBUILT = ("input_ids", "attention_mask", "position_ids")


@dataclass
class Group:
    """One prompt's samples: where it came from, when it was admitted, its trajectories once finished."""

    key: tuple[int, int]
    """(loader batch, row): the synchronous run's (step, row)."""
    prompts: Batch
    """The prompt row."""
    admitted_at: int = 0
    """Steps the trainer had trained when the group was admitted."""
    trajectories: Optional[list[Trajectory]] = None


class IdleClock:
    """Seconds the engines spent idle (no request in flight, or paused for an update) since the last read."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.idle, self.since, self.running, self.paused = 0.0, clock(), 0, False

    def change(self, running: int = 0, paused: Optional[bool] = None) -> None:
        now = self.clock()
        if self.running == 0 or self.paused:
            self.idle += now - self.since
        self.since, self.running = now, self.running + running
        self.paused = self.paused if paused is None else paused

    def read(self) -> float:
        self.change()
        idle, self.idle = self.idle, 0.0
        return idle


class Producer:
    """The rollout side of asynchronous training; every public method is called from the trainer's thread."""

    def __init__(self, trainer: RLTrainer, cursor: Optional[dict], version: int):
        cfg, asy = trainer.cfg, trainer.cfg.async_training
        self.engines, self.agents, self.loader = trainer.cluster.rollout, trainer.agents, trainer.data.loader
        self.params, self.seed, self.n = trainer.sampling, cfg.trainer.seed, trainer.sampling.n
        self.per_step, self.staleness, self.over_stale = cfg.trainer.prompts_per_step, asy.max_staleness, asy.over_stale
        self.capacity = asy.max_concurrent_rollouts or self.per_step * self.n * (asy.max_staleness + 1)
        self.lock, self.clock = threading.Condition(), IdleClock()
        self.trained = self.started = self.running = self.dropped = self.interrupted = 0
        self.version, self.paced, self.error, self.last_take = version, 0.0, None, time.perf_counter()
        self.groups: dict[tuple[int, int], Group] = {}  # admitted, not yet trained
        self.batches: dict[int, dict] = {}  # loader batch → loader state before it, rows, rows trained
        self.retry: deque[Group] = deque()  # dropped groups, admitted again first
        self.rows: deque[Group] = deque()
        cursor = cursor or {"batch": trainer.step + 1, "loader": self.loader.state_dict(), "trained": {}}
        self.next_batch, self.skip = int(cursor["batch"]), {int(k): set(v) for k, v in cursor["trained"].items()}
        self.loader.load_state_dict(cursor["loader"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="megarl-rollouts", daemon=True)
        self.tasks: set = set()
        self.wake = asyncio.Event()  # set (on the loop) whenever admission may have become possible

    # ------------------------------------------------------------------ the producer's loop (its own thread)

    def start(self) -> None:
        self.thread.start()
        self.main = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)

    async def _produce(self) -> None:
        try:
            while True:
                group, waited = self._next_group(), time.perf_counter()
                while True:
                    self.wake.clear()
                    if self._admit(group):
                        break
                    await self.wake.wait()
                with self.lock:
                    self.paced += time.perf_counter() - waited
        except Exception as err:  # noqa: BLE001 -- e.g. the loader: the trainer stops the run with it
            with self.lock:
                self.error = err
                self.lock.notify_all()

    def _next_group(self) -> Group:
        """A dropped group first, else the next row of the current loader batch (skipping rows a resumed
        run already trained)."""
        if self.retry:
            return self.retry.popleft()
        while not self.rows:
            with self.lock:
                k, before = self.next_batch, self.loader.state_dict()
                prompts = self.loader.next_batch()
                self.batches[k] = {"loader": before, "rows": len(prompts), "trained": self.skip.pop(k, set())}
                self.next_batch += 1
            self.rows.extend(
                Group((k, r), prompts[r : r + 1]) for r in range(len(prompts)) if r not in self.batches[k]["trained"]
            )
        return self.rows.popleft()

    def admit(self, group: Group) -> bool:
        """Count `group` in (True) if the staleness bound and max_concurrent_rollouts allow it now."""
        with self.lock:
            if (
                self.started + 1 > (self.trained + 1 + self.staleness) * self.per_step
                or self.running + self.n > self.capacity
            ):
                return False
            self.started, self.running = self.started + 1, self.running + self.n
            self.clock.change(self.n)
            group.admitted_at, group.trajectories = self.trained, None
            self.groups[group.key] = group
            return True

    def _admit(self, group: Group) -> bool:
        if not self.admit(group):
            return False
        task = self.loop.create_task(self._run(group))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _run(self, group: Group) -> None:
        (k, row), error, trajectories = group.key, None, None
        try:
            trajectories = await self.agents.group(
                group.prompts, 0, self.params, step_seed(self.seed, k) + row, session=f"{k}.0:{row}"
            )
        except Exception as err:  # noqa: BLE001 -- handed to the trainer, which stops the run with it
            error = err
        self.finish(group, trajectories if error is None else None, error)
        self.wake.set()

    def finish(self, group: Group, trajectories: Optional[list[Trajectory]], error: Optional[BaseException] = None):
        """A group's samples are done: into the buffer (or its error to the trainer)."""
        with self.lock:
            self.running -= self.n
            self.clock.change(-self.n)
            if error is not None:
                self.error = error
            else:
                group.trajectories = trajectories
            self.lock.notify_all()

    def call(self, coroutine, timeout: Optional[float] = None):
        """Run a coroutine on the producer's loop (the one the router is bound to); its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    # ------------------------------------------------------------------ the trainer's side

    def take(self, timeout_s: Optional[float] = None) -> tuple[list[Group], dict]:
        """The next batch's groups (by key), waiting until they are finished; the buffer's metrics.
        (`timeout_s`: give up with TimeoutError after that long.)"""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        with self.lock:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"a rollout of the asynchronous producer failed: {self.error!r}") from self.error
                if self.over_stale == "drop":
                    self._drop_stale()
                picked, depth = self._pick()
                if picked:
                    break
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no batch of {self.per_step} groups within {timeout_s} s")
                self.lock.wait(timeout=0.2 if deadline else 1.0)
            for group in picked:
                del self.groups[group.key]
                self.batches[group.key[0]]["trained"].add(group.key[1])
            stats = {
                "async/buffer_depth": float(depth),
                "async/dropped": float(self.dropped),
                "async/paced_seconds": self.paced,
                "async/in_flight": float(self.running),
                "async/reruns": float(self.engines.router.reruns),
                "async/interrupted": float(self.interrupted),
                "time/engine_idle_share": self.clock.read() / max(time.perf_counter() - self.last_take, 1e-9),
            }
            self.dropped, self.paced, self.interrupted, self.last_take = 0, 0.0, 0, time.perf_counter()
        return picked, stats

    def _pick(self) -> tuple[list[Group], int]:
        finished = sorted((g for g in self.groups.values() if g.trajectories is not None), key=lambda g: g.key)
        due = (
            []
            if self.over_stale == "drop"
            else sorted(
                (g for g in self.groups.values() if g.admitted_at <= self.trained - self.staleness), key=lambda g: g.key
            )
        )
        if len(finished) < self.per_step or any(g.trajectories is None for g in due):
            return [], len(finished)
        chosen = due[: self.per_step]
        chosen += [g for g in finished if g not in chosen][: self.per_step - len(chosen)]
        return sorted(chosen, key=lambda g: g.key), len(finished)

    def _drop_stale(self) -> None:
        """over_stale=drop: finished groups whose oldest token lags more than max_staleness versions go back
        to the queue (counted in async/dropped)."""
        for group in [g for g in self.groups.values() if g.trajectories is not None]:
            versions = [v for t in group.trajectories for v in t.response_versions if v >= 0]
            if versions and min(versions) < self.version - self.staleness:
                self.dropped += len(group.trajectories)
                self.started -= 1
                del self.groups[group.key]
                self.retry.append(group)
                if self.thread.is_alive():
                    self.loop.call_soon_threadsafe(self.wake.set)

    def step_done(self, version: Optional[int]) -> None:
        """A step was trained (and, unless None, the engines now serve `version`): admission moves on."""
        with self.lock:
            self.trained += 1
            self.version = self.version if version is None else version
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.wake.set)

    @contextlib.contextmanager
    def paused(self, mode: str):
        """The engines paused (pause mode `mode`) inside the block; resumed even when it raises."""
        with self.lock:
            self.clock.change(paused=True)
            self.interrupted += self.running
        self.call(self.engines.pause(mode))
        try:
            yield
        finally:
            self.call(self.engines.resume())
            with self.lock:
                self.clock.change(paused=False)

    def state_dict(self) -> dict:
        """The data cursor aligned with what was trained: the loader state before the oldest loader batch
        with an untrained row, the rows of it and later batches already trained, and (for the record) the
        groups buffered or in flight now, which a resumed run regenerates first."""
        with self.lock:
            open_ = [k for k, b in sorted(self.batches.items()) if len(b["trained"]) < b["rows"]]
            first = open_[0] if open_ else self.next_batch
            for k in [k for k in self.batches if k < first]:
                del self.batches[k]
            loader = self.batches[first]["loader"] if first in self.batches else self.loader.state_dict()
            return {
                "batch": first,
                "loader": loader,
                "trained": {k: sorted(b["trained"]) for k, b in self.batches.items() if b["trained"]},
                "pending": sorted(self.groups) + sorted(g.key for g in self.retry),
            }

    def stop(self) -> None:
        """Cancel the producer and its groups, end its loop and thread."""
        if not self.thread.is_alive():
            self.loop.close()
            return

        async def cancel():
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        self.main.cancel()
        with contextlib.suppress(Exception):
            self.call(cancel(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


class AsyncRLTrainer(RLTrainer):
    """The RL loop with generation overlapping training (trainer.mode=async); `RLTrainer`'s phases."""

    producer: Optional[Producer] = None
    pushed: Optional[int] = None
    """The engines' policy version after this step's weight update."""

    def fit(self) -> list[dict]:
        try:
            return super().fit()
        finally:
            if self.producer is not None:
                self.producer.stop()

    def resume(self) -> int:
        """Continue from a checkpoint (if any), then start the producer at its data cursor."""
        step = super().resume()
        cursor = self.resumed_state.rollouts if self.resumed_state is not None else None
        self.producer = Producer(self, cursor, version=max(self.cluster.rollout.versions()))
        self.producer.start()
        self.agents.run_coroutine = self.producer.call  # validation's agent loops use the router's loop too
        return step

    def train_step(self, step: int) -> dict:
        """Take a batch of finished groups from the buffer, score it, train on it (`RLTrainer.learn`)."""
        timer = PhaseTimer()
        with timer("generate"):  # the trainer waits for finished groups
            groups, stats = self.producer.take()
        batch = self.assemble(groups)
        stats.update(agent_metrics([t for g in groups for t in g.trajectories], max(timer.total, 1e-9)))
        stats.update(staleness_metrics(batch, self.producer.version))
        with timer("reward"):
            batch = self.shape(self.score(batch))
        metrics = self.learn(step, batch, stats, timer)
        self.producer.step_done(self.pushed if self.actor_trains(step) else None)
        metrics["time/trainer_idle_share"] = timer.seconds["generate"] / max(timer.total, 1e-9)
        return metrics

    def assemble(self, groups: list[Group]) -> Batch:
        """The training rows of the groups, in key order, with the synchronous run's group ids."""
        prompts = Batch.concat([g.prompts.select(*[k for k in g.prompts.keys() if k not in _REBUILT]) for g in groups])
        batch = batching.trajectory_batch(prompts, [g.trajectories for g in groups], self.data.pad_token_id)
        batch["uid"] = np.array([f"{g.key[0]}.0:{g.key[1]}" for g in groups for _ in g.trajectories], dtype=object)
        return batch

    def push_weights(self) -> int:
        """Pause the engines (async_training.on_update), load the new weights, resume."""
        before = self.producer.version
        with self.producer.paused(PAUSE_MODE[self.cfg.async_training.on_update]):
            try:
                self.pushed = super().push_weights()
            except Exception as err:
                raise RuntimeError(
                    f"weight update after version {before} failed; the engines keep serving"
                    f" version(s) {self.cluster.rollout.versions()} and the run stops: {err}"
                ) from err
        return self.pushed

    def driver_state(self, step: int):
        cursor = self.producer.state_dict()
        return replace(super().driver_state(step), loader=cursor["loader"], rollouts=cursor)


def staleness_metrics(batch: Batch, version: int) -> dict:
    """Trainer version minus the version of each trained response token: max, mean, share per lag; and the
    samples whose tokens come from more than one version (requests that ran across an update)."""
    versions, mask = batch["response_versions"], batch["response_mask"].bool() & (batch["response_versions"] >= 0)
    lag = (version - versions)[mask].float()
    if lag.numel() == 0:
        return {}
    out = {"async/staleness_max": float(lag.max()), "async/staleness_mean": float(lag.mean())}
    for d in range(int(lag.max()) + 1):
        out[f"async/staleness_share/{d}"] = float((lag == d).float().mean())
    spans = [torch.unique(versions[i][mask[i]]).numel() for i in range(len(batch))]
    out["async/mixed_version_samples"] = float(sum(s > 1 for s in spans))
    return out
