"""The asynchronous producer's scheduling rules, without engines: admission under the staleness bound,
which finished groups a batch takes (pace: the due ones first; drop: stale ones dropped and resubmitted),
the data cursor a checkpoint records, the engines' idle clock, and the driver's side of a weight update
the engines reject (the engines' side: tests/rollout/test_server_mode.py)."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from megarl.agent.single_turn import completion_trajectory
from megarl.config.schema import RunConfig
from megarl.data.datasets import DataConfig, PromptDataset, PromptLoader
from megarl.data.tasks import write_task_splits
from megarl.data.tokenizer import build_tiny_tokenizer
from megarl.rollout.base import Completion, SamplingParams, WeightUpdateError
from megarl.rollout.router import EngineRouter
from megarl.trainer.async_loop import AsyncRLTrainer, IdleClock, Producer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    paths = write_task_splits("arithmetic", 40, str(tmp_path_factory.mktemp("async_data")), chat=False)
    return PromptDataset(DataConfig(files=[paths["train"]], apply_chat_template=False), build_tiny_tokenizer())


def producer(dataset, staleness=1, over_stale="pace", cursor=None, engines=None):
    """Prompts per step 2, samples per prompt 2; the loader real, the engines never called (unless given)."""
    cfg = RunConfig()
    cfg.trainer.prompts_per_step, cfg.rollout.samples_per_prompt = 2, 2
    cfg.async_training.max_staleness, cfg.async_training.over_stale = staleness, over_stale
    trainer = SimpleNamespace(
        cfg=cfg,
        cluster=SimpleNamespace(rollout=engines or SimpleNamespace(router=EngineRouter(1))),
        agents=None,
        step=0,
        data=SimpleNamespace(loader=PromptLoader(dataset, 2, seed=1)),
        sampling=SamplingParams(n=2),
    )
    return Producer(trainer, cursor, version=0)


def done(version=0):
    return [completion_trajectory([1], Completion([3, 4], [-0.1, -0.2], "stop", version, versions=[version] * 2))] * 2


def test_admission_stops_at_the_bound_and_a_batch_waits_for_its_due_groups(dataset):
    p = producer(dataset, staleness=1)
    groups = [p._next_group() for _ in range(5)]
    assert [g.key for g in groups] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert [p.admit(g) for g in groups] == [True, True, True, True, False]  # (0 + 1 + 1) * 2 groups
    for g in groups[1:4]:
        p.finish(g, done())
    first, stats = p.take(timeout_s=1)
    assert [g.key for g in first] == [(1, 1), (2, 0)] and stats["async/buffer_depth"] == 3
    p.step_done(version=1)
    assert p.admit(groups[4])  # a step trained: two more groups may start
    with pytest.raises(TimeoutError):
        p.take(timeout_s=0.3)  # (1, 0) was admitted a step ago: the next batch must hold it
    p.finish(groups[0], done())
    assert [g.key for g in p.take(timeout_s=1)[0]] == [(1, 0), (2, 1)]
    p.stop()


def test_the_cursor_points_at_the_oldest_batch_with_an_untrained_group_and_a_resume_skips_the_trained(dataset):
    p = producer(dataset, staleness=1)
    before = p.loader.state_dict()
    groups = [p._next_group() for _ in range(4)]
    for g in groups:
        p.admit(g)
    for g in groups[1:]:
        p.finish(g, done())
    p.take(timeout_s=1)  # trains (1, 1) and (2, 0)
    cursor = p.state_dict()
    assert cursor["batch"] == 1 and cursor["loader"] == before
    assert cursor["trained"] == {1: [1], 2: [0]} and cursor["pending"] == [(1, 0), (2, 1)]
    p.stop()
    resumed = producer(dataset, staleness=1, cursor=cursor)
    again = [resumed._next_group() for _ in range(3)]
    assert [g.key for g in again] == [(1, 0), (2, 1), (3, 0)]
    assert again[0].prompts["input_ids"].tolist() == groups[0].prompts["input_ids"].tolist()  # the same prompts
    assert again[1].prompts["input_ids"].tolist() == groups[3].prompts["input_ids"].tolist()
    resumed.stop()


def test_drop_mode_drops_resubmits_and_counts_too_stale_groups(dataset):
    p = producer(dataset, staleness=0, over_stale="drop")
    a, b = p._next_group(), p._next_group()
    assert p.admit(a) and p.admit(b)
    p.finish(a, done(version=0))
    p.finish(b, done(version=2))
    p.version = 2  # two updates happened meanwhile: a's tokens are 2 versions old
    with pytest.raises(TimeoutError):
        p.take(timeout_s=0.3)
    assert p.dropped == 2 and p._next_group() is a and a.key not in p.groups
    assert p.admit(a)  # the bound counts it again
    p.finish(a, done(version=2))
    picked, stats = p.take(timeout_s=1)
    assert [g.key for g in picked] == [(1, 0), (1, 1)] and stats["async/dropped"] == 2
    p.stop()


def test_idle_clock_counts_time_without_requests_or_paused():
    now = [0.0]
    clock = IdleClock(lambda: now[0])
    now[0] = 1.0  # idle: nothing in flight
    clock.change(running=2)
    now[0] = 3.0  # busy
    assert clock.read() == 1.0
    clock.change(paused=True)
    now[0] = 3.5  # paused for an update with requests in flight: idle
    clock.change(paused=False)
    now[0] = 4.0
    clock.change(running=-2)
    now[0] = 4.25
    assert clock.read() == 0.75


def updating_on(on_update):
    cfg = RunConfig()
    cfg.async_training.on_update = on_update
    return cfg


class RejectingEngines:
    """Engines serving version 3 that reject the next update (as an engine server does when the weights do
    not fit its model: tests/rollout/test_server_mode.py); they record pause and resume."""

    router = EngineRouter(1)

    def __init__(self):
        self.calls = []

    async def pause(self, mode):
        self.calls.append(f"pause {mode}")

    async def resume(self):
        self.calls.append("resume")

    def sync_weights(self):
        raise WeightUpdateError("engine server 0 rejected the update: model.norm.weight has shape (64,), not (32,)")

    def versions(self):
        return [3]


@pytest.mark.parametrize("on_update", ["continue", "abort"])
def test_a_rejected_weight_update_stops_the_run_naming_the_version_served_and_resumes_the_engines(dataset, on_update):
    engines = RejectingEngines()
    p = producer(dataset, engines=engines)
    p.version, p.main = 3, Future()
    p.thread.start()  # the producer's loop, which pause and resume run on (no groups admitted)
    trainer = AsyncRLTrainer.__new__(AsyncRLTrainer)
    trainer.cfg, trainer.cluster, trainer.producer = updating_on(on_update), SimpleNamespace(rollout=engines), p
    with pytest.raises(
        RuntimeError, match=r"after version 3 failed; the engines keep serving version\(s\) \[3\]"
    ) as err:
        trainer.push_weights()
    assert "model.norm.weight" in str(err.value) and isinstance(err.value.__cause__, WeightUpdateError)
    assert engines.calls == [f"pause {'keep' if on_update == 'continue' else 'abort'}", "resume"]
    assert not p.clock.paused  # the engines count as serving again
    p.stop()
    assert not p.thread.is_alive()
