"""Rank meshes, DP splitting and result collection, pool bundles: pure logic, no Ray."""

import pytest
import torch

from megarl.config import load_config
from megarl.controller import (
    DPSplit,
    RankMesh,
    ResourcePool,
    local_ray_resources,
    plan_placement,
    pools_from_config,
    role_mesh,
)
from megarl.data.batch import Batch
from megarl.models.layout import ParallelLayout


def test_rank_mesh_tp2_pp2_dp2_matches_megatron_group_enumeration():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.hyper_comm_grid import HyperCommGrid

        from megarl.engine.parallel import _DENSE_DIMS  # the grid the engine builds its groups from

    layout, world = ParallelLayout(tp=2, pp=2, cp=2), 16
    mesh = RankMesh(layout, world)
    grid = HyperCommGrid.__new__(HyperCommGrid)  # only the enumeration, no process groups
    grid.rank_offset = 0
    sizes = {"tp": 2, "cp": 2, "dp": mesh.dp_size, "pp": 2}
    names = list(_DENSE_DIMS)
    shape = [sizes[n] for n in names]
    for dim in ("tp", "cp", "dp", "pp"):
        for group in HyperCommGrid._gen_rank_enum_for(grid, shape, names, [dim]):
            rest = [d for d in ("tp", "cp", "dp", "pp") if d != dim]
            others = {tuple(getattr(mesh.coords[r], d) for d in rest) for r in group}
            assert len(others) == 1, f"{dim} group {group} mixes other coordinates"
            assert sorted(getattr(mesh.coords[r], dim) for r in group) == list(range(len(group)))


def test_collect_ranks_are_first_tp_cp0_last_stage():
    mesh = RankMesh(ParallelLayout(tp=2, pp=2), 8)  # dp = 2
    assert mesh.dp_size == 2
    assert mesh.collect_ranks() == [4, 6]  # pp=1 (last), tp=0, dp=0 / dp=1
    assert mesh.ranks_of_dp(0) == [0, 1, 4, 5]
    assert RankMesh(ParallelLayout(), 3).collect_ranks() == [0, 1, 2]


def _batch(lengths):
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return Batch.from_dict(
        {"attention_mask": mask, "row": torch.arange(len(lengths))},
        {"uid": [f"g{i // 2}" for i in range(len(lengths))]},
    )


def test_dp_split_balances_tokens_and_restores_row_order():
    batch = _batch([9, 1, 1, 1, 8, 2, 2, 8])
    split = DPSplit.of(batch, 2)
    assert [len(s) for s in split.shards] == [4, 4]
    tokens = [int(s["attention_mask"].sum()) for s in split.shards]
    assert abs(tokens[0] - tokens[1]) == 4  # the best 4+4 split (14 vs 18); contiguous halves give 12 vs 20
    # a rank's result is row-aligned with its shard; restore() undoes the permutation
    results = [Batch.from_dict({"row_x10": s["row"] * 10}) for s in split.shards]
    assert torch.equal(split.restore(results)["row_x10"], torch.arange(8) * 10)


def test_dp_split_keeps_groups_together_and_rejects_indivisible_rows():
    batch = _batch([3, 3, 1, 1, 5, 5, 2, 2])
    split = DPSplit.of(batch, 2, group_key="uid")
    for shard in split.shards:
        uids = list(shard["uid"])
        assert all(uids.count(u) == 2 for u in uids)
    assert [len(s) for s in DPSplit.of(batch, 4, balance=False).shards] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="8 rows cannot be split evenly over data-parallel size 3"):
        DPSplit.of(batch, 3)
    with pytest.raises(ValueError, match="has 1 rows, its input had 4"):
        DPSplit.of(batch, 2).restore([batch[:1], batch[:4]])


def test_pool_bundles_slots_and_pools_from_config():
    pool = ResourcePool.from_nodes(2, 4, cpus_per_worker=2)
    assert pool.world_size == 8
    assert pool.bundles() == [{"GPU": 4.0, "CPU": 8.0}] * 2
    slots = pool.slots()
    assert [(s.bundle, s.local_rank) for s in slots[3:5]] == [(0, 3), (1, 0)]
    assert ResourcePool([2], use_gpu=False).bundles() == [{"CPU": 2.0}]
    with pytest.raises(ValueError, match="cpus_per_worker > 0"):
        ResourcePool([2], use_gpu=False, cpus_per_worker=0)
    cfg = load_config(
        overrides=["resources.nodes=3", "resources.gpus_per_node=8", "resources.pools={main: 16, rollout: 8}"]
    )
    pools = pools_from_config(cfg)
    assert pools["main"].bundle_sizes == [8, 8] and pools["rollout"].bundle_sizes == [8]
    cpu = pools_from_config(load_config("configs/grpo_quickstart.yaml"))["main"]
    assert not cpu.use_gpu and cpu.bundles() == [{"CPU": 2.0}]


def test_placement_plan_colocates_roles_and_puts_a_server_rollout_on_its_pool():
    ppo = load_config("configs/ppo_quickstart.yaml")
    assert plan_placement(ppo) == {"main": ["actor", "ref", "critic", "rollout"]}
    assert role_mesh(ppo, "critic").dp_size == 2 and role_mesh(ppo, "actor").collect_ranks() == [0]
    with pytest.raises(ValueError, match="role 'reward_model' is not active"):
        role_mesh(ppo, "reward_model")
    split = load_config(
        "configs/qwen2.5-7b_grpo_gsm8k.yaml",
        ["resources.nodes=2", "resources.pools={main: 8, gen: 8}", "rollout.mode=server", "rollout.pool=gen"],
    )
    assert plan_placement(split) == {"main": ["actor", "ref"], "gen": ["rollout"]}
    assert local_ray_resources(load_config("configs/grpo_quickstart.yaml"))["num_gpus"] == 0
