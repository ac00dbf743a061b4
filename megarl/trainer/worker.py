"""What runs inside each Ray worker process: one class per role, composed per process.

Owns: `ProcessSetup` (the process's torch.distributed world, CPU patches, threads, seeds) and the
role classes the driver adds to a `WorkerGroup`, each holding its own Megatron engine on its own
process groups (`build_role_groups`), so roles in one process keep separate layouts:

    ActorWorker        log-probs + entropy, policy updates, checkpoints, HF export
    ReferenceWorker    frozen policy log-probs (KL terms)
    CriticWorker       values, value updates, checkpoints
    RewardModelWorker  model scores at the last response token

The rollout roles (a colocated engine, or the sender to engine servers) are in
`megarl.trainer.rollout_roles`. Roles are built in the same order in every process (group creation
is collective); a rollout role finds the actor of its own process through `local_role("actor")`.
Every method runs
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
