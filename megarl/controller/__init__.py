"""The Ray controller: resource pools, worker groups per pool, and which rank gets which rows.

    resource_pool.py  ResourcePool (placement group of node-sized bundles), RankSlot, pools_from_config
    worker_group.py   WorkerGroup / WorkerHost: one actor per rank with its rendezvous env; roles
                      composed in the same processes (colocation) or on their own pool's group;
                      execute_all / execute_rank0 / dispatch + collect return or resolve Ray futures
    placement.py      plan_placement (pool -> roles in its processes), role_mesh, init_ray
    dispatch.py       RankMesh (rank -> dp, tp, pp, cp in megatron order), DPSplit (token-balanced
                      DP shards of a Batch and the inverse permutation for results)

The RL loop (megarl.trainer) drives roles through these. Ray is imported lazily: importing this
package does not import Ray, megatron or vLLM.
"""
from megarl.controller.dispatch import DPSplit, RankCoord, RankMesh, row_lengths
from megarl.controller.placement import init_ray, local_ray_resources, plan_placement, role_mesh
from megarl.controller.resource_pool import RankSlot, ResourcePool, pools_from_config
from megarl.controller.worker_group import DPCall, WorkerError, WorkerGroup, WorkerHost

__all__ = ["DPCall", "DPSplit", "RankCoord", "RankMesh", "RankSlot", "ResourcePool", "WorkerError", "WorkerGroup", "WorkerHost",
           "init_ray", "local_ray_resources", "plan_placement", "pools_from_config", "role_mesh", "row_lengths"]
