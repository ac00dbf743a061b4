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
    fork_server.py    the process a local CPU run's workers fork from (it imports their stack once);
                      fork_launch.py, the command Ray starts for each, asks it for a fork

The RL loop (megarl.trainer) drives roles through these. Ray is imported lazily: importing this
package does not import Ray, megatron or vLLM (cluster.py imports the role classes, not their engines),
nor torch (its names load their modules on first use).
"""

import importlib

# Each name from its module, imported on first use: `fork_server` must import without torch (`megarl train`
# starts the fork server before the driver imports it), and `dispatch` imports torch.
_HOMES = {
    "dispatch": ["DPSplit", "RankCoord", "RankMesh", "row_lengths"],
    "placement": ["init_ray", "local_ray_resources", "plan_placement", "role_mesh", "shutdown_ray"],
    "resource_pool": ["RankSlot", "ResourcePool", "pools_from_config"],
    "worker_group": ["DPCall", "RoleHandle", "WorkerError", "WorkerGroup", "WorkerHost", "role_handle"],
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


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
