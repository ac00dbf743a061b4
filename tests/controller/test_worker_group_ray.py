"""Worker groups on a real local Ray with fake GPUs: placement, rendezvous env, colocated roles,
DP dispatch/collect, typed role handles, separate pools, errors. One Ray session for the module (start ~3 s)."""

import contextlib
import os
import sys

import pytest
import torch

from megarl.controller import RankMesh, ResourcePool, WorkerError, WorkerGroup
from megarl.controller.worker_group import role_handle
from megarl.data.batch import Batch
from megarl.models.layout import ParallelLayout
from megarl.utils.remote import ALL, METRICS, ROWS, remote

ray = pytest.importorskip("ray")


class EchoRole:
    """A role that reports where it runs and transforms its DP shard."""

    def __init__(self, scale: int):
        self.scale = scale
        self.rank = int(os.environ["RANK"])  # the rendezvous env is set before roles are built

    def where(self) -> dict:
        keys = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
        )
        return {"pid": os.getpid(), "gpu": [str(g) for g in ray.get_gpu_ids()], **{k: os.environ.get(k) for k in keys}}

    def forward(self, batch: Batch) -> Batch:
        return Batch.from_dict({"out": batch["row"] * self.scale, "rank": torch.full((len(batch),), self.rank)})

    def all_reduce_ranks(self) -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// from the rendezvous env (MASTER_ADDR/PORT, RANK, WORLD_SIZE)
        total = torch.tensor([self.rank])
        dist.all_reduce(total)
        dist.destroy_process_group()
        return int(total)

    def fail(self):
        raise ValueError(f"rank {self.rank} refuses")


class HandledRole(EchoRole):
    """EchoRole with `@remote` methods for typed handles, and a call boundary that counts entries."""

    def __init__(self, scale: int):
        super().__init__(scale)
        self.inside = 0

    @contextlib.contextmanager
    def boundary(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    @remote(ROWS)
    def scaled(self, batch: Batch) -> Batch:
        """Rows times the scale, and how deep inside the boundary the call ran."""
        return Batch.from_dict({"out": batch["row"] * self.scale, "inside": torch.full((len(batch),), self.inside)})

    @remote(METRICS)
    def metrics(self, batch: Batch) -> dict:
        return {"rank": self.rank, "rows": len(batch)}

    @remote(ALL)
    def rank_of(self) -> int:
        return self.rank

    def not_remote(self) -> None:
        """Not callable from the driver."""


@pytest.fixture(scope="module")
def ray_session():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test classes travel by value
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    from megarl.controller import shutdown_ray

    shutdown_ray()  # no 1 s wait on Ray's autoscaler monitor


@pytest.fixture(scope="module")
def group(ray_session):
    """Two fake nodes x 2 GPUs, an actor and a critic role colocated in the same 4 processes."""
    group = WorkerGroup(ResourcePool([2, 2], cpus_per_worker=0.5, name="main"))
    group.add_role("actor", EchoRole, 10)
    group.add_role("critic", EchoRole, scale=100)  # same processes, its own object
    yield group
    group.shutdown()


def test_two_node_pool_sets_rendezvous_env_and_colocates_roles(group):
    actor = ray.get(group.execute_all("actor.where"))
    critic = ray.get(group.execute_all("critic.where"))
    assert [a["pid"] for a in actor] == [c["pid"] for c in critic]
    assert [a["RANK"] for a in actor] == ["0", "1", "2", "3"]
    assert {a["WORLD_SIZE"] for a in actor} == {"4"} and len({a["MASTER_PORT"] for a in actor}) == 1
    assert [a["LOCAL_RANK"] for a in actor] == ["0", "1", "0", "1"]
    assert sorted(g for a in actor for g in a["gpu"]) == ["0", "1", "2", "3"]  # one fake GPU each
    for a in actor:  # all GPUs of its bundle visible; LOCAL_RANK indexes its own
        visible = a["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == 2 and visible[int(a["LOCAL_RANK"])] == a["gpu"][0]
    assert ray.get(group.execute_rank0("critic.where"))["RANK"] == "0"
    assert ray.get(group.execute_all("actor.all_reduce_ranks")) == [0 + 1 + 2 + 3] * 4  # a real gloo world


def test_dispatch_splits_by_dp_and_collects_from_first_tp_rank_last_stage(group):
    mask = torch.ones(8, 4, dtype=torch.long)
    mask[::3, 2:] = 0  # uneven lengths: the split balances tokens
    batch = Batch.from_dict({"row": torch.arange(8), "attention_mask": mask})
    mesh = RankMesh(ParallelLayout(tp=2), 4)  # dp = 2: ranks (0,1) and (2,3)
    call = group.dispatch("actor.forward", batch, mesh)
    out = group.collect(call)
    assert torch.equal(out["out"], torch.arange(8) * 10)  # back in input order
    assert set(out["rank"].tolist()) == {0, 2}  # TP rank 0 of each DP shard
    pp_mesh = RankMesh(ParallelLayout(pp=2), 4)  # dp = 2 over ranks (0, 2) / (1, 3); last stage 2, 3
    assert set(group.collect(group.dispatch("actor.forward", batch, pp_mesh))["rank"].tolist()) == {2, 3}
    dp_out = group.collect(group.dispatch("actor.forward", batch, RankMesh(ParallelLayout(), 4)))  # shards by value
    assert torch.equal(dp_out["out"], torch.arange(8) * 10) and set(dp_out["rank"].tolist()) == {0, 1, 2, 3}
    with pytest.raises(
        WorkerError,
        match=r"group 'main' rank 0: ValueError: rank 0 refuses"
        r" \(also failed: ranks \[1, 2, 3\]\)",
    ):
        group.get(group.execute_all("actor.fail"))
    with pytest.raises(WorkerError, match="rank 0: ValueError: 'reward.forward': no role 'reward' in this worker"):
        group.get([group.execute_rank0("reward.forward", batch)])
    with pytest.raises(WorkerError, match="rank 0: ValueError: role 'actor' already exists in this worker"):
        group.add_role("actor", EchoRole, 1)


def test_typed_handles_call_role_methods_as_their_remote_mark_says(group):
    group.add_role("handled", HandledRole, 3)
    handle = role_handle(group, "handled", HandledRole, RankMesh(ParallelLayout(tp=2), 4))  # dp 2
    batch = Batch.from_dict({"row": torch.arange(8), "attention_mask": torch.ones(8, 2, dtype=torch.long)})
    out = handle.scaled(batch)
    assert torch.equal(out["out"], torch.arange(8) * 3)  # rows split over DP, merged in input order
    assert out["inside"].tolist() == [1] * 8  # ran inside the role's boundary, once
    assert handle.metrics(batch) == {"rank": 0, "rows": 4}  # one collecting rank's result
    assert handle.rank_of() == 0  # every rank called, rank 0 answers
    assert handle.scaled.__doc__ == HandledRole.scaled.__doc__  # the handle's method is the role's
    with pytest.raises(AttributeError, match=r"HandledRole.not_remote is not a remote method .* \['metrics', "):
        _ = handle.not_remote


def test_separate_gpu_and_cpu_pools_and_a_pool_larger_than_the_cluster(ray_session, group):
    group.shutdown()  # free the module group's GPUs
    actors = WorkerGroup(ResourcePool([1], cpus_per_worker=0.5, name="actor"))
    rollouts = WorkerGroup(ResourcePool([1], use_gpu=False, cpus_per_worker=0.5, name="rollout"))  # CPU pool
    try:
        actors.add_role("actor", EchoRole, 1)
        rollouts.add_role("rollout", EchoRole, 2)
        gpus_a = {g for w in ray.get(actors.execute_all("actor.where")) for g in w["gpu"]}
        gpus_r = {g for w in ray.get(rollouts.execute_all("rollout.where")) for g in w["gpu"]}
        assert len(gpus_a) == 1 and not gpus_r  # the CPU pool's worker holds no GPU
        rollout_env = ray.get(rollouts.execute_rank0("rollout.where"))
        assert (rollout_env["RANK"], rollout_env["WORLD_SIZE"], rollout_env["LOCAL_RANK"]) == (
            "0",
            "1",
            "0",
        )  # own world
    finally:
        actors.shutdown()
        rollouts.shutdown()
    with pytest.raises(RuntimeError, match=r"pool 'big' needs 8 GPUs .* the Ray cluster has 4"):
        WorkerGroup(ResourcePool([8], name="big", cpus_per_worker=0))
