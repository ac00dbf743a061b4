"""The driver's handle on the run's workers: typed role handles and the rollout engines.

Owns: `Cluster`. It creates one `WorkerGroup` per resource pool that holds model roles, builds the
active roles of `megarl.workers` in them (a `ProcessSetup` first, then the roles in build order:
roles of one pool share its processes, each on its own process groups), adds the rollout engines
(`megarl.controller.engines`: colocated in the actor's workers, or servers on their own pool), and
hands the loop one typed handle per role:

    cluster.actor.compute_log_probs(batch)     # `megarl.workers.Actor.compute_log_probs`, rows over DP
    cluster.critic.update(batch)               # None when the config has no critic
    cluster.rollout.generate(requests); cluster.rollout.sync_weights(); with cluster.rollout.asleep(): ...

Ray is imported by the worker groups (the driver).
"""

from __future__ import annotations

import time
from typing import Optional, Union

from megarl.controller.engines import ColocatedEngines, EngineServers
from megarl.controller.placement import plan_placement, role_mesh
from megarl.controller.resource_pool import pools_from_config, worker_env, worker_threads
from megarl.controller.worker_group import WorkerGroup, role_handle
from megarl.workers import MODEL_ROLES, Actor, Critic, ProcessSetup, Reference, RewardModel


class Cluster:
    """Worker groups per pool with the run's roles built in their processes; a handle per role."""

    actor: Actor
    ref: Optional[Reference]
    critic: Optional[Critic]
    reward_model: Optional[RewardModel]
    rollout: Union[ColocatedEngines, EngineServers]

    def __init__(self, cfg, derived):
        self.cfg, self.derived = cfg, derived
        self.startup: dict[str, float] = {}  # seconds per start-up phase (printed by `megarl train`)
        start = time.perf_counter()
        pools, plan = pools_from_config(cfg), plan_placement(cfg, derived)
        plan = {name: [r for r in roles if r != "rollout"] for name, roles in plan.items()}  # engines: below
        threads = worker_threads(cfg)
        env = worker_env(threads)
        self.groups: dict[str, WorkerGroup] = {}
        for name in sorted((n for n in plan if plan[n]), key=lambda n: n != cfg.actor.pool):
            self.groups[name] = self._worker_group(pools[name], env, threads)
        self.startup["processes"], start = time.perf_counter() - start, time.perf_counter()
        for role in MODEL_ROLES:
            setattr(self, role, None)
        for name, roles in plan.items():  # build order: actor, ref, critic, reward model
            for i, role in enumerate(roles):
                self.groups[name].add_role(role, MODEL_ROLES[role].from_config, cfg, first=i == 0)
                setattr(
                    self, role, role_handle(self.groups[name], role, MODEL_ROLES[role], role_mesh(cfg, role, derived))
                )
        self.startup["models"], start = time.perf_counter() - start, time.perf_counter()
        actor_group = self.groups[cfg.actor.pool]
        if cfg.rollout.mode == "server":
            self.rollout = EngineServers(cfg, pools[cfg.rollout.pool], actor_group, env)
        else:
            self.rollout = ColocatedEngines(cfg, actor_group)
        self.startup["engines"] = time.perf_counter() - start
        for group in self.groups.values():  # what the start-up built stays out of the training's collections
            group.get(group.execute_all("process.freeze_heap"))

    def _worker_group(self, pool, env: dict, threads: int) -> WorkerGroup:
        group = WorkerGroup(pool, name=pool.name, env=env)
        res = self.cfg.resources
        group.add_role("process", ProcessSetup, res.accelerator, self.cfg.trainer.seed, threads, res.bind_cpus)
        return group

    def trainable_roles(self) -> dict[str, object]:
        """{name: handle} of the active roles with an optimizer (what a checkpoint holds)."""
        return {name: h for name, h in (("actor", self.actor), ("critic", self.critic)) if h is not None}

    def shutdown(self) -> None:
        self.rollout.shutdown()
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
