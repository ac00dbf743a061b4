"""The rollout engines as the driver sees them: colocated in the actor's workers, or servers on their own pool.

Owns `ColocatedEngines` (rollout.mode=colocated: engines inside every `rollout.tp`-th actor rank, role
"rollout" = `megarl.workers.Rollout`) and `EngineServers` (rollout.mode=server: engine actors placed
on the bundles of `rollout.pool`, fed by broadcast over a weight group whose rank 0 is actor rank 0,
role "rollout" = `megarl.workers.RolloutSender`). Both offer what the loop uses (`cluster.rollout`):

    generate(requests)   [(prompt ids, SamplingParams)] dealt to the engines in contiguous chunks
    sync_weights()       the actor's weights into every engine; their (common) new policy version
    versions()           the engines' current policy versions
    asleep(timer)        a context: colocated engines give their GPU memory (weights, KV cache) to
                         the training phases inside it; servers keep theirs

Ray is imported here (the driver).
"""
from __future__ import annotations

import contextlib
from typing import Optional

from megarl.workers.rollout import Rollout, RolloutSender, engine_ranks, engine_spec


def _deal(requests: list, parts: int) -> list[list]:
    """`requests` cut into `parts` contiguous chunks of near-equal size."""
    bounds = [len(requests) * i // parts for i in range(parts + 1)]
    return [requests[bounds[i]:bounds[i + 1]] for i in range(parts)]


def _common_version(versions: list[Optional[int]]) -> int:
    """The engines' policy version after a sync (they must agree)."""
    known = {v for v in versions if v is not None}
    if len(known) != 1:
        raise RuntimeError(f"rollout engines disagree on the policy version after a weight sync: {versions}")
    return known.pop()


class _Engines:
    """What both placements share: sleeping around the training phases."""

    def sleep(self) -> None:
        """Give the engines' GPU memory to training (colocated); servers keep theirs."""

    def wake_up(self) -> None:
        pass

    @contextlib.contextmanager
    def asleep(self, timer=None):
        """The engines asleep inside the block (woken even when it raises); `timer` (a
        `PhaseTimer`) times the two transitions as phases engine_sleep and engine_wake."""
        timed = timer or (lambda phase: contextlib.nullcontext())
        with timed("engine_sleep"):
            self.sleep()
        try:
            yield
        finally:
            with timed("engine_wake"):
                self.wake_up()


class ColocatedEngines(_Engines):
    """Engines in the actor's own worker processes (role "rollout" = `megarl.workers.Rollout`)."""

    def __init__(self, cfg, actor_group):
        self.group = actor_group
        self.group.add_role("rollout", Rollout, cfg)
        self.ranks = engine_ranks(actor_group.world_size, cfg.rollout.tp)

    def generate(self, requests: list) -> list:
        per_rank: list[tuple] = [([],) for _ in range(self.group.world_size)]
        for rank, chunk in zip(self.ranks, _deal(requests, len(self.ranks))):
            per_rank[rank] = (chunk,)
        results = self.group.get(self.group.execute_per_rank("rollout.generate", per_rank))
        return [c for rank in self.ranks for c in results[rank]]

    def sync_weights(self) -> int:
        versions = self.group.get(self.group.execute_all("rollout.sync_weights"))
        return _common_version([versions[r] for r in self.ranks])

    def versions(self) -> list[int]:
        versions = self.group.get(self.group.execute_all("rollout.version"))
        return [versions[r] for r in self.ranks]

    def sleep(self) -> None:
        self.group.get(self.group.execute_all("rollout.sleep"))

    def wake_up(self) -> None:
        self.group.get(self.group.execute_all("rollout.wake_up"))

    def shutdown(self) -> None:
        """The engines go with the actor's workers."""


class EngineServers(_Engines):
    """Engine actors on their own pool; the actor's rank 0 broadcasts each update to all of them."""

    def __init__(self, cfg, pool, actor_group, env: dict, timeout_s: float = 600.0):
        import ray

        from megarl.rollout.server import connect_servers, launch_engine_servers

        ro, res = cfg.rollout, cfg.resources
        self.pool, self.group, self.timeout_s = pool, actor_group, timeout_s
        backend, kwargs = engine_spec(cfg)
        slots = pool.slots()[::ro.tp]  # an engine's first GPU; its tp GPUs share a bundle (validated)
        options = [{**pool.actor_options(slot, num_gpus=float(ro.tp) if pool.use_gpu else 0.0),
                    "num_cpus": ro.tp * res.cpus_per_worker} for slot in slots]
        self.servers = launch_engine_servers(cfg.model.hf_path, len(slots), backend=backend, actor_options=options,
                                             env=env, **kwargs)
        ray.get([server.version.remote() for server in self.servers])  # started (or their own error)
        self.group.add_role("rollout", RolloutSender, cfg)
        host, port = self.group.env[0]["MASTER_ADDR"], ray.get(self.group.workers[0].free_port.remote())
        weights_backend = "nccl" if pool.use_gpu else "gloo"
        joins = connect_servers(self.servers, host, port, backend=weights_backend, timeout_s=timeout_s)
        self.group.get([self.group.execute_rank0("rollout.connect", host, port, len(self.servers) + 1,
                                                 weights_backend, timeout_s)])
        ray.get(joins)

    def generate(self, requests: list) -> list:
        import ray

        refs = [server.generate.remote(ids, params)
                for server, chunk in zip(self.servers, _deal(requests, len(self.servers))) for ids, params in chunk]
        return ray.get(refs)

    def sync_weights(self) -> int:
        import ray

        updates = [server.receive_update.remote() for server in self.servers]
        self.group.get(self.group.execute_all("rollout.sync_weights"))
        return _common_version(ray.get(updates, timeout=self.timeout_s))

    def versions(self) -> list[int]:
        import ray

        return ray.get([server.version.remote() for server in self.servers])

    def shutdown(self) -> None:
        import ray

        for server in self.servers:
            ray.kill(server)
        self.servers = []
        self.pool.remove()
