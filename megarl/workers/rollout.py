"""The rollout role: a colocated engine fed by the actor's sharding manager, or the sender to engine servers.

Owns the two classes the driver composes into the actor's worker processes as role "rollout"
(their driver side is `megarl.controller.engines`):

    Rollout         rollout.mode=colocated: an engine in every `rollout.tp`-th actor rank (vLLM, or
                    the embedded fallback), its weights pushed in place from the actor after updates
    RolloutSender   rollout.mode=server: the actor replica holding rank 0 gathers HF-named buckets
                    on rank 0, which broadcasts them to the engine servers over a weight group

and `engine_spec(cfg)`, the one place an engine's constructor arguments come from (colocated
engines here; engine servers, which pick their backend where they run, through `engine_specs` in
`megarl.controller.engines`). Both stamp the engines' policy version
with the actor's optimizer step, which a resumed run restores.

Imports vLLM, megatron and torch.distributed only inside the worker processes (lazily).
"""

from __future__ import annotations

import os
from typing import Optional

from megarl.workers.base import local_role, outside_device_mode, register_local


def engine_specs(cfg) -> dict[str, dict]:
    """{backend: keyword arguments} for every backend `rollout.engine` allows, for engines started in
    other processes (engine servers), which resolve 'auto' where they run: the driver that builds
    these may have no vLLM (a CPU head node) while the rollout nodes have it."""
    names = ("vllm", "embedded") if cfg.rollout.engine == "auto" else (cfg.rollout.engine,)
    return {name: engine_spec(cfg, name)[1] for name in names}


def engine_ranks(world_size: int, rollout_tp: int) -> list[int]:
    """Ranks that host a colocated engine: the first rank of every `rollout_tp` ranks."""
    return list(range(0, world_size, rollout_tp))


def engine_spec(cfg, backend: Optional[str] = None) -> tuple[str, dict]:
    """(backend, keyword arguments of `megarl.rollout.create_engine`) for the run's engines.

    backend: None resolves `rollout.engine` in this process ('auto': vLLM where it imports here), which
    is right only in the process that starts the engine; else the arguments for that backend.
    """
    from megarl.config.validate import resolve_max_model_len
    from megarl.engine.engine import resolve_dtype
    from megarl.rollout import resolve_backend

    ro = cfg.rollout
    backend = resolve_backend(backend or ro.engine)
    # by the run's accelerator, as the actor's workers resolve it: the caller may be a GPU-less driver (server mode)
    dtype = resolve_dtype(cfg.actor.dtype if ro.dtype == "auto" else ro.dtype, cfg.resources.accelerator == "gpu")
    if backend == "embedded":
        return backend, {"dtype": dtype, "device": "cuda" if cfg.resources.accelerator == "gpu" else "cpu"}
    kwargs = dict(
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=resolve_max_model_len(cfg),
        seed=cfg.trainer.seed,
        tensor_parallel_size=ro.tp,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        enforce_eager=ro.enforce_eager,
    )
    # vLLM's engine core runs in a child process (AsyncLLM); updates reach its workers as IPC buckets
    return backend, kwargs


class Rollout:
    """The colocated rollout engine of this process and the sharding manager feeding it."""

    name = "rollout"

    def __init__(self, cfg):
        import torch.distributed as dist

        from megarl.rollout import create_engine
        from megarl.rollout.sharding.senders import sender_for

        ro = cfg.rollout
        self.rank = dist.get_rank()
        hosts = engine_ranks(dist.get_world_size(), ro.tp)
        self.engine = None
        if cfg.resources.accelerator == "gpu":  # vLLM counts what the trainers cached (offloaded roles
            self.release_cached_memory()  # too) as used at its start, on every GPU of an engine:
            dist.barrier()  # all ranks release before any engine starts
        if self.rank in hosts:
            backend, kwargs = engine_spec(cfg)
            if backend == "vllm" and cfg.resources.accelerator == "gpu":
                # vLLM numbers the GPUs it sees from 0: its core (and TP workers) must see exactly this
                # rank's `rollout.tp` GPUs; updates cross as CUDA IPC buckets.
                kwargs.update(visible_devices=_rank_gpus(ro.tp))
            self.engine = create_engine(cfg.model.hf_path, backend=backend, **kwargs)
        self.sender = None if self.engine is None else sender_for(self.engine, verify=ro.verify_weights, adopt=True)
        self.manager = _sharding_manager(local_role("actor").engine, set(hosts), ro.sync_bucket_mb)
        register_local(self.name, self)

    def generate(self, requests: list, request_ids: Optional[list] = None, session_ids: Optional[list] = None) -> list:
        """[(prompt ids, SamplingParams)] → per request, its list of `Completion`s.

        Safe to call from many threads at once (the worker host runs these calls in its request
        concurrency group): every call's requests join the engine's running batch.
        """
        if not requests:
            return []
        import asyncio

        request_ids = request_ids or [None] * len(requests)
        session_ids = session_ids or [None] * len(requests)

        async def run():
            return await asyncio.gather(
                *(
                    self.engine.generate(ids, params, request_id=rid, session_id=sid)
                    for (ids, params), rid, sid in zip(requests, request_ids, session_ids)
                )
            )

        return list(self.engine.run_sync(run()))

    def abort(self, request_ids: list) -> None:
        """End these requests now; their `generate` calls return the partial outputs."""
        if self.engine is not None:
            self.engine.run_sync(self.engine.abort(request_ids))

    def pause(self, mode: str = "keep") -> None:
        """Stop generating (`megarl.rollout.base.PAUSE_MODES`) until `resume`."""
        if self.engine is not None:
            self.engine.run_sync(self.engine.pause(mode))

    def resume(self) -> None:
        if self.engine is not None:
            self.engine.run_sync(self.engine.resume())

    def sync_weights(self) -> Optional[int]:
        """Push the actor's current weights into the engines (every rank of the actor takes part)."""
        actor = local_role("actor")
        with actor.resident(), outside_device_mode():  # the manager places its tensors itself
            return self.manager.sync(self.sender, version=actor.engine.step)

    def version(self) -> Optional[int]:
        return None if self.engine is None else self.engine.version

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def release_cached_memory(self) -> None:
        """Give the CUDA blocks this process's training phases cached back to the driver, so an engine
        (vLLM's core and TP workers: other processes, on this rank's GPU too at rollout TP > 1) can take
        them. Every rank calls it before the engines wake (`ColocatedEngines.wake_up`), as verl does."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()


def _rank_gpus(count: int) -> str:
    """This rank's GPU and the next `count - 1` of its node, as CUDA_VISIBLE_DEVICES ids (the worker
    host lists its node's GPUs in local-rank order; `rollout.tp` divides the GPUs per node)."""
    visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return ",".join(visible[local : local + count])


class RolloutSender:
    """Server mode: the replica of rank 0 gathers the actor's weights; rank 0 broadcasts them.

    Other DP replicas hold the same weights and skip the sync. `connect` (rank 0 only) creates the
    sender's side of the weight group the servers join (`megarl.rollout.server.connect_servers`).
    """

    name = "rollout"

    def __init__(self, cfg):
        import torch.distributed as dist

        self.rank, self.verify, self.delta = dist.get_rank(), cfg.rollout.verify_weights, cfg.rollout.delta_weights
        actor = local_role("actor").engine
        self.sends = 0 in dist.get_process_group_ranks(_replica_group(actor))
        self.manager = _sharding_manager(actor, {0}, cfg.rollout.sync_bucket_mb) if self.sends else None
        self.sender = None
        register_local(self.name, self)

    def connect(self, host: str, port: int, world_size: int, backend: str, timeout_s: float = 300.0) -> None:
        """Rank 0: form the weight group with the engine servers (they join as ranks 1..N)."""
        from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup

        if self.rank == 0:
            self.sender = BroadcastSender(
                WeightGroup(host, port, 0, world_size, backend=backend, timeout_s=timeout_s),
                verify=self.verify,
                delta=self.delta,
            )

    def sync_weights(self) -> Optional[int]:
        """Every actor rank calls this while the servers wait in `receive_update`; rank 0 returns the version."""
        if not self.sends:
            return None
        actor = local_role("actor")
        with actor.resident(), outside_device_mode():  # the manager places its tensors itself
            return self.manager.sync(self.sender, version=actor.engine.step)

    def close(self) -> None:
        """Rank 0: release the servers from their receive loop."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _replica_group(actor_engine):
    """The ranks that together hold one full copy of the weights: TP×PP, and ×EP for MoE models."""
    groups = actor_engine.groups
    return groups.pg.tp_ep_pp if actor_engine.config.layout.ep > 1 else groups.pg.mp


def _sharding_manager(actor_engine, hosts: set[int], bucket_mb: int):
    """A manager per actor replica, in buckets of `bucket_mb` MiB; it feeds the ranks of `hosts` inside that replica."""
    import torch.distributed as dist

    from megarl.rollout.sharding.manager import ShardingManager, TrainGroups

    groups, layout = actor_engine.groups, actor_engine.config.layout
    replica_group = _replica_group(actor_engine)
    train_groups = TrainGroups(
        groups.pg.tp, replica_group, groups.tp_rank, groups.pp_rank, layout.tp, layout.pp, groups.ep_rank, layout.ep
    )
    replica = dist.get_process_group_ranks(replica_group)
    return ShardingManager(
        actor_engine.bridge,
        actor_engine.chunks,
        train_groups,
        rollout_ranks=[r for r in replica if r in hosts],
        bucket_bytes=bucket_mb << 20,
    )
