"""Server mode: rollout engines as Ray actors with their own resources, fed weights by broadcast.

Owns: `EngineServer` (an engine inside an async Ray actor: concurrent `generate` calls — one
request each, with a request id and a session id — join the engine's running batch; `abort`,
`pause` / `resume` pass through; weight updates arrive over a `WeightGroup` from one trainer rank,
and the engine pauses itself around each load, its `update_mode`) and
`launch_engine_servers` / `connect_servers`, the driver-side helpers. The trainer rank that
holds the gathered weights (the sharding manager's rollout rank) is rank 0 of the weight group
and calls `ShardingManager.sync(BroadcastSender(group), version)`; the driver asks every server to
`receive_update()` for each sync (the server's engine takes the policy version the trainer sends). On CPU the group is gloo (tested with the embedded engine and
the vLLM CPU build), and servers on the trainer's host read each bucket from its shared memory
(`BroadcastSender(shm=True)`); on GPU pass backend="nccl".

Imports Ray only inside the helpers, so the module imports without it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional, Sequence

from megarl.rollout.base import Completion, SamplingParams


class EngineServer:
    """The body of the engine actor (wrap with `ray.remote`; `launch_engine_servers` does)."""

    def __init__(self, model_path: str, backend: str = "auto", *, per_backend: Optional[dict] = None, **engine_kwargs):
        """per_backend: {backend: keyword arguments}; 'auto' is resolved here, in the server's process
        (whether vLLM imports on this node), and that backend's arguments are used."""
        from megarl.rollout import create_engine, resolve_backend

        backend = resolve_backend(backend)
        if per_backend is not None:
            if backend not in per_backend:
                raise ValueError(f"no engine arguments for backend {backend!r} (given: {', '.join(per_backend)})")
            engine_kwargs = {**per_backend[backend], **engine_kwargs}
        self.backend = backend
        self.engine = create_engine(model_path, backend=backend, **engine_kwargs)
        self._receiver = None
        self._joined = threading.Event()  # Ray may start receive_update before join_weight_group

    async def backend_name(self) -> str:
        """The backend this server runs ('auto' resolved on its node)."""
        return self.backend

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        *,
        request_id: Optional[str] = None,
        session_id: Optional[str] = None,
    ) -> list[Completion]:
        return await self.engine.generate(prompt_token_ids, params, request_id=request_id, session_id=session_id)

    async def generate_batch(self, prompts, params: SamplingParams = SamplingParams()) -> list[list[Completion]]:
        return await self.engine.generate_batch(prompts, params)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.engine.abort(request_ids)

    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def score(self, sequences) -> list[list[float]]:
        return await asyncio.to_thread(self.engine.score, sequences)

    async def join_weight_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0
    ) -> None:
        """Join the trainer's weight group as `rank` (≥ 1); returns once the group is formed.

        A first `receive_update` may be sent before this resolves; when re-joining a new group,
        wait for this call before asking for updates from it.
        """
        self._joined.clear()
        from megarl.rollout.sharding.broadcast import BroadcastReceiver, WeightGroup

        def join():
            return BroadcastReceiver(
                WeightGroup(host, port, rank, world_size, backend=backend, timeout_s=timeout_s), self.engine
            )

        self._receiver = await asyncio.to_thread(join)
        self._joined.set()

    async def receive_update(self, join_timeout_s: float = 300.0) -> Optional[int]:
        """Wait for one update from the weight group; the new version (None: the sender closed)."""
        if not await asyncio.to_thread(self._joined.wait, join_timeout_s):
            raise RuntimeError(f"no weight group joined within {join_timeout_s} s: call join_weight_group()")
        return await asyncio.to_thread(self._receiver.receive_update)

    async def version(self) -> int:
        return self.engine.version

    async def num_requests(self) -> int:
        """Requests in flight (queued or running) on this server's engine."""
        return self.engine.num_requests

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.engine.wake_up)


def launch_engine_servers(
    model_path: str,
    num_servers: int,
    *,
    backend: str = "auto",
    num_cpus: float = 1,
    num_gpus: float = 0,
    actor_options: Optional[Sequence[dict]] = None,
    env: Optional[dict] = None,
    per_backend: Optional[dict] = None,
    **engine_kwargs,
) -> list:
    """Start `num_servers` engine actors, each with its own CPUs/GPUs (Ray must be initialised).

    actor_options: per server, Ray options that replace num_cpus/num_gpus (e.g. a placement-group
    bundle from `ResourcePool.actor_options`); env: environment variables of the server processes;
    per_backend: {backend: engine arguments}, each server resolving `backend` ('auto') on its node.
    """
    import ray

    actor = ray.remote(EngineServer)
    options = list(actor_options or [{"num_cpus": num_cpus, "num_gpus": num_gpus}] * num_servers)
    if len(options) != num_servers:
        raise ValueError(f"{len(options)} actor_options for {num_servers} servers")
    runtime_env = {"env_vars": dict(env)} if env else None
    return [
        actor.options(runtime_env=runtime_env, **opts).remote(
            str(model_path), backend, per_backend=per_backend, **engine_kwargs
        )
        for opts in options
    ]


def connect_servers(servers: list, host: str, port: int, *, backend: str = "gloo", timeout_s: float = 300.0) -> list:
    """Ask the servers to join a weight group as ranks 1..N (the trainer rank joins as rank 0).

    Returns the Ray refs of the joins; they resolve once the trainer rank has created its side.
    """
    world = len(servers) + 1
    return [s.join_weight_group.remote(host, port, i + 1, world, backend, timeout_s) for i, s in enumerate(servers)]
