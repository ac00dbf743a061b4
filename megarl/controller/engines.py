"""The rollout engines as the driver sees them: colocated in the actor's workers, or servers on their own pool.

Owns `ColocatedEngines` (rollout.mode=colocated: engines inside every `rollout.tp`-th actor rank, role
"rollout" = `megarl.workers.Rollout`) and `EngineServers` (rollout.mode=server: engine actors placed
on the bundles of `rollout.pool`, fed by broadcast over a weight group whose rank 0 is actor rank 0,
role "rollout" = `megarl.workers.RolloutSender`). Both offer what the loop uses (`cluster.rollout`):

    generate(requests)   [(prompt ids, SamplingParams)] dealt to the engines in contiguous chunks
                         (the synchronous single-turn batch path)
    sync_weights()       the actor's weights into every engine; their (common) new policy version
    versions()           the engines' current policy versions
    asleep(timer)        a context: colocated engines give their GPU memory (weights, KV cache) to
                         the training phases inside it; servers keep theirs. On CPU a colocated
                         engine has nothing to give: sleeping is the driver's flag alone (no call
                         reaches the workers) and generating refuses until the block ends

and, per request, for agent loops and asynchronous training (awaited on the driver's event loop):

    await submit(prompt_ids, params, request_id=..., session_id=...)   # → list of Completion
    await abort(request_ids)          # those requests return their partial outputs
    await pause(mode); await resume() # every engine (`megarl.rollout.base.PAUSE_MODES`)

`submit` routes with `megarl.rollout.router.EngineRouter`: every turn of a session to the engine
that served its first turn, a new session to the engine with the fewest outstanding requests, at
most `max_outstanding` per engine, and a request an engine aborted for a weight update (pause mode
abort) runs again. Colocated engines take each request as a call in the worker host's request
concurrency group (`REQUEST_GROUP`), so many run at once next to the (idle) training calls.

Ray is imported here (the driver).
"""

from __future__ import annotations

import contextlib
from typing import Optional

from megarl.controller.worker_group import REQUEST_CONCURRENCY, REQUEST_GROUP
from megarl.rollout.router import DEFAULT_MAX_OUTSTANDING, EngineRouter
from megarl.workers.rollout import Rollout, RolloutSender, engine_ranks, engine_specs


def _deal(requests: list, parts: int) -> list[list]:
    """`requests` cut into `parts` contiguous chunks of near-equal size."""
    bounds = [len(requests) * i // parts for i in range(parts + 1)]
    return [requests[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _common_version(versions: list[Optional[int]]) -> int:
    """The engines' policy version after a sync (they must agree)."""
    known = {v for v in versions if v is not None}
    if len(known) != 1:
        raise RuntimeError(f"rollout engines disagree on the policy version after a weight sync: {versions}")
    return known.pop()


class _Engines:
    """What both placements share: per-request routing, and sleeping around the training phases."""

    router: EngineRouter

    async def submit(self, prompt_ids, params, *, request_id: str, session_id: Optional[str] = None) -> list:
        """`params.n` completions of one request, on the engine the router picks (sticky per session)."""
        return await self.router.run(
            str(request_id),
            session_id,
            lambda engine: self._call(engine, prompt_ids, params, str(request_id), session_id),
        )

    async def abort(self, request_ids) -> None:
        """End outstanding requests; their `submit` calls return the partial outputs (not rerun)."""
        import asyncio

        by_engine = self.router.abort([str(r) for r in request_ids])
        await asyncio.gather(*(self._abort(engine, ids) for engine, ids in by_engine.items()))

    async def _call(self, engine: int, prompt_ids, params, request_id: str, session_id) -> list:
        raise NotImplementedError

    async def _abort(self, engine: int, request_ids: list) -> None:
        raise NotImplementedError

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

    def __init__(self, cfg, actor_group, max_outstanding: int = REQUEST_CONCURRENCY):
        self.group = actor_group
        self.group.add_role("rollout", Rollout, cfg)
        self.ranks = engine_ranks(actor_group.world_size, cfg.rollout.tp)
        self.router = EngineRouter(len(self.ranks), max_outstanding=min(max_outstanding, REQUEST_CONCURRENCY))
        self.frees_memory = cfg.resources.accelerator == "gpu"
        """Asleep, the engines free GPU memory (a call to every worker); on CPU both engine backends
        only raise a flag, so the driver keeps that flag itself (2 calls and ~4 ms a step saved)."""
        self.sleeping = False

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError(
                "the rollout engines are asleep (the training phases of a step hold them); generate outside `asleep()`"
            )

    def _request(self, engine: int, method: str, *args):
        """A call of the rollout role on engine `engine`'s rank, in the request concurrency group."""
        worker = self.group.workers[self.ranks[engine]]
        return worker.call.options(concurrency_group=REQUEST_GROUP).remote(f"rollout.{method}", *args)

    async def _call(self, engine, prompt_ids, params, request_id, session_id):
        self._check_awake()
        return (await self._request(engine, "generate", [(list(prompt_ids), params)], [request_id], [session_id]))[0]

    async def _abort(self, engine, request_ids):
        await self._request(engine, "abort", request_ids)

    async def pause(self, mode: str = "keep") -> None:
        import asyncio

        await asyncio.gather(*(self._request(e, "pause", mode) for e in range(len(self.ranks))))

    async def resume(self) -> None:
        import asyncio

        await asyncio.gather(*(self._request(e, "resume") for e in range(len(self.ranks))))

    def generate(self, requests: list) -> list:
        self._check_awake()
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
        if self.frees_memory:
            self.group.get(self.group.execute_all("rollout.sleep"))
        self.sleeping = True

    def wake_up(self) -> None:
        if self.frees_memory:
            # every rank first, then the engines: an engine at rollout TP > 1 also wakes on its neighbours' GPUs
            self.group.get(self.group.execute_all("rollout.release_cached_memory"))
            self.group.get(self.group.execute_all("rollout.wake_up"))
        self.sleeping = False

    def shutdown(self) -> None:
        """The engines go with the actor's workers."""


class EngineServers(_Engines):
    """Engine actors on their own pool; the actor's rank 0 broadcasts each update to all of them."""

    def __init__(
        self,
        cfg,
        pool,
        actor_group,
        env: dict,
        timeout_s: float = 600.0,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
    ):
        import ray

        from megarl.rollout.server import connect_servers, launch_engine_servers

        ro, res = cfg.rollout, cfg.resources
        self.pool, self.group, self.timeout_s = pool, actor_group, timeout_s
        slots = pool.slots()[:: ro.tp]  # an engine's first GPU; its tp GPUs share a bundle (validated)
        options = [
            {
                **pool.actor_options(slot, num_gpus=float(ro.tp) if pool.use_gpu else 0.0),
                "num_cpus": ro.tp * res.cpus_per_worker,
            }
            for slot in slots
        ]
        self.servers = launch_engine_servers(  # each server resolves rollout.engine=auto on its own node
            cfg.model.hf_path,
            len(slots),
            backend=ro.engine,
            actor_options=options,
            env=env,
            per_backend=engine_specs(cfg),
        )
        ray.get([server.version.remote() for server in self.servers])  # started (or their own error)
        _same_backend(ray.get([server.backend_name.remote() for server in self.servers]), ro.engine)
        self.group.add_role("rollout", RolloutSender, cfg)
        host, port = self.group.env[0]["MASTER_ADDR"], ray.get(self.group.workers[0].free_port.remote())
        weights_backend = "nccl" if pool.use_gpu else "gloo"
        joins = connect_servers(self.servers, host, port, backend=weights_backend, timeout_s=timeout_s)
        self.group.get(
            [self.group.execute_rank0("rollout.connect", host, port, len(self.servers) + 1, weights_backend, timeout_s)]
        )
        ray.get(joins)
        self.router = EngineRouter(len(self.servers), max_outstanding=max_outstanding)

    async def _call(self, engine, prompt_ids, params, request_id, session_id):
        return await self.servers[engine].generate.remote(
            list(prompt_ids), params, request_id=request_id, session_id=session_id
        )

    async def _abort(self, engine, request_ids):
        await self.servers[engine].abort.remote(request_ids)

    async def pause(self, mode: str = "keep") -> None:
        """Pause every server (e.g. around a weight update, so all switch versions together)."""
        import asyncio

        await asyncio.gather(*(server.pause.remote(mode) for server in self.servers))

    async def resume(self) -> None:
        import asyncio

        await asyncio.gather(*(server.resume.remote() for server in self.servers))

    def generate(self, requests: list) -> list:
        import ray

        refs = [
            server.generate.remote(ids, params)
            for server, chunk in zip(self.servers, _deal(requests, len(self.servers)))
            for ids, params in chunk
        ]
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


def _same_backend(backends: list[str], asked: str) -> None:
    """Engine servers that resolved rollout.engine=auto on their nodes must agree (vLLM on some nodes and
    the embedded engine on others would give one run two samplers of different numerics and speed)."""
    if len(set(backends)) > 1:
        where = ", ".join(f"server {i}: {b}" for i, b in enumerate(backends))
        raise RuntimeError(
            f"rollout.engine={asked} resolved differently on the rollout nodes ({where}): install the same vLLM"
            " on every rollout node, or set rollout.engine=vllm (or embedded) to require one"
        )
