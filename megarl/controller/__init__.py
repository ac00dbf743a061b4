"""The Ray controller: resource pools, worker groups per pool, typed role handles, which rank gets which rows.

    cluster.py        Cluster: the run's worker groups with the roles of `megarl.workers` built in
                      them; typed handles `cluster.actor`, `cluster.critic`, ... and `cluster.rollout`
    engines.py        the rollout engines seen from the driver: colocated, or servers on their own pool
    resource_pool.py  ResourcePool (placement group of node-sized bundles), RankSlot, pools_from_config
    worker_group.py   WorkerGroup / WorkerHost: one actor per rank with its rendezvous env; roles
                      composed in the same processes (colocation) or on their own pool's group;
                      execute_all / execute_rank0 / dispatch + collect return or resolve Ray futures;
                      RoleHandle: a role's `@remote` methods called as their mark says
    placement.py      plan_placement (pool -> roles in its processes), role_mesh, init_ray, shutdown_ray
    dispatch.py       RankMesh (rank -> dp, tp, pp, cp in megatron order), DPSplit (token-balanced
                      DP shards of a Batch and the inverse permutation for results)

The RL loop (megarl.trainer) drives roles through these. Ray is imported lazily: importing this
package does not import Ray, megatron or vLLM (cluster.py imports the role classes, not their engines).
"""

from megarl.controller.dispatch import DPSplit, RankCoord, RankMesh, row_lengths
from megarl.controller.placement import init_ray, local_ray_resources, plan_placement, role_mesh, shutdown_ray
from megarl.controller.resource_pool import RankSlot, ResourcePool, pools_from_config
from megarl.controller.worker_group import DPCall, RoleHandle, WorkerError, WorkerGroup, WorkerHost, role_handle

__all__ = [
    "DPCall",
    "DPSplit",
    "RankCoord",
    "RankMesh",
    "RankSlot",
    "ResourcePool",
    "RoleHandle",
    "WorkerError",
    "WorkerGroup",
    "WorkerHost",
    "init_ray",
    "shutdown_ray",
    "local_ray_resources",
    "plan_placement",
    "pools_from_config",
    "role_handle",
    "role_mesh",
    "row_lengths",
]
