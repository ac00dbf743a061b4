"""Colocated engines asleep: on CPU the driver keeps the flag (no call to the workers), on GPU every worker sleeps."""

import pytest

from megarl.config import load_config
from megarl.controller.engines import ColocatedEngines


class RecordingGroup:
    """The part of a `WorkerGroup` that `ColocatedEngines` drives, recording each call (no Ray here)."""

    world_size = 2

    def __init__(self):
        self.calls = []

    def add_role(self, name, cls, cfg):
        self.calls.append(("add_role", name))

    def execute_all(self, target):
        self.calls.append(target)
        return [target] * self.world_size

    def execute_per_rank(self, target, per_rank):
        self.calls.append(target)
        return [[["completion"] * len(chunk)] for (chunk,) in per_rank]

    def get(self, refs):
        return refs


def engines(accelerator: str) -> tuple[ColocatedEngines, RecordingGroup]:
    cfg = load_config("configs/grpo_quickstart.yaml", [f"resources.accelerator={accelerator}"])
    group = RecordingGroup()
    return ColocatedEngines(cfg, group), group


def test_cpu_engines_sleep_as_a_driver_flag_and_refuse_to_generate_meanwhile():
    cpu, group = engines("cpu")
    with cpu.asleep():
        with pytest.raises(RuntimeError, match="rollout engines are asleep"):
            cpu.generate([([1, 2], None)])
    assert group.calls == [("add_role", "rollout")]  # no sleep / wake_up call reached a worker
    assert not cpu.sleeping and cpu.generate([([1, 2], None), ([3], None)]) == [["completion"]] * 2
    with pytest.raises(ValueError), cpu.asleep():  # woken even when the block raises
        raise ValueError("training failed")
    assert not cpu.sleeping


def test_gpu_engines_sleep_on_every_worker_and_every_rank_releases_its_cache_before_any_wakes():
    """An engine at rollout TP > 1 wakes on its neighbours' GPUs too: every rank's cached CUDA blocks
    must be back with the driver (a finished call on every rank) before the first engine wakes."""
    gpu, group = engines("gpu")
    with gpu.asleep():
        assert gpu.sleeping
    assert group.calls[1:] == ["rollout.sleep", "rollout.release_cached_memory", "rollout.wake_up"]


@pytest.mark.parametrize("accelerator,dtype", [("gpu", "bfloat16"), ("cpu", "float32")])
def test_engine_dtype_auto_follows_the_runs_accelerator_not_the_callers_machine(accelerator, dtype):
    """Server mode builds the engines' arguments on the driver, which may have no GPU: "auto" must give
    the dtype the actor's GPU workers train in (bf16), not the driver's CPU default (float32)."""
    from megarl.workers.rollout import engine_spec

    cfg = load_config(
        "configs/grpo_quickstart.yaml",
        [f"resources.accelerator={accelerator}", "actor.dtype=auto", "rollout.dtype=auto", "rollout.engine=embedded"],
    )
    backend, kwargs = engine_spec(cfg)
    assert backend == "embedded" and str(kwargs["dtype"]) == f"torch.{dtype}"
