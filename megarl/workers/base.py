"""What every worker process and every model role shares.

Owns: `ProcessSetup` (the process's torch.distributed world, CPU patches, threads, CPU share, seed;
built first in every worker), `EngineRole` (the base of the roles that hold a Megatron engine: the call
boundary, checkpoints, HF export), `build_engine` (a role's engine on its own process groups) and
`local_role` (a role built earlier in the same process, e.g. the actor the rollout role feeds).

The call boundary: the driver's worker host runs every call to a role inside `role.boundary()`.
For an engine role that is megatron's CPU device mode (a no-op on GPU; thread-local, and Ray may
call methods on another thread than the one that built the role) and, for an offloaded role, its
engine onloaded for the call and offloaded again after. Roles never repeat this per method.

Imports megatron only inside functions (the module imports on a CPU machine without it); no Ray.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from megarl.utils.remote import ALL, remote

_LOCAL: dict[str, object] = {}


def local_role(name: str):
    """A role built earlier in this process (e.g. the rollout role's actor)."""
    if name not in _LOCAL:
        raise RuntimeError(f"no {name!r} role in this worker process; roles here: {sorted(_LOCAL)}")
    return _LOCAL[name]


def register_local(name: str, role) -> None:
    """Make `role` findable by `local_role(name)` in this process."""
    _LOCAL[name] = role


@contextlib.contextmanager
def device_mode():
    """Megatron's CPU device mode (CUDA calls mapped to the CPU); a no-op on GPU or when active."""
    from megatron_patches import cpu_device_mode

    with cpu_device_mode():
        yield


@contextlib.contextmanager
def outside_device_mode():
    """The device mode off on this thread for megarl's own tensor code (it places tensors itself): its
    torch calls skip the mode's Python hook. A no-op on GPU, where there is no mode."""
    from megatron_patches import device_mode_suspended

    with device_mode_suspended():
        yield


class ProcessSetup:
    """The process: CPU patches (CPU only), torch.distributed over the worker group, threads, seed; on CPU
    (`bind_cpus`) its share of the node's CPUs (`keep_to_cpu_share`)."""

    def __init__(self, accelerator: str, seed: int, threads: int = 1, bind_cpus: bool = True):
        import torch.distributed as dist

        if accelerator == "cpu":
            from megatron_patches import apply_cpu_patches

            apply_cpu_patches()
            torch.set_num_threads(max(1, threads))
            if bind_cpus:
                keep_to_cpu_share(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
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

    def freeze_heap(self) -> None:
        """Keep what the start-up built (imports, models, the engine's frontend) out of this process's garbage
        collections from now on (`gc.freeze`), as the driver does (`megarl.trainer.run`). A worker Ray starts
        plainly (GPUs; `resources.fork_workers=false` on CPU) held ~0.6 M tracked objects after it: each full
        collection during training walked them all, 300-370 ms, twice in the CPU quickstart's 100 steps, with
        the other ranks waiting for it at the next collective. Workers forked from the fork server inherit its
        imports frozen already; this freezes what they built after the fork too."""
        import gc

        gc.freeze()


def cpu_share(cpus: list[int], local_rank: int, local_size: int) -> list[int]:
    """The CPUs of local rank `local_rank` of `local_size`: a contiguous share of `cpus`; with fewer CPUs
    than ranks, one CPU, the ranks spread evenly over them."""
    n = len(cpus)
    start = local_rank * n // local_size
    return cpus[start : max(start + 1, (local_rank + 1) * n // local_size)]


def keep_to_cpu_share(local_rank: int, local_size: int) -> None:
    """Every thread of this worker process (and so every thread and process it starts later: the vLLM
    engine core it forks, torch's threads) keeps to the rank's share of the CPUs it may use (`cpu_share`).

    Why: a CPU run's ranks each drive an engine (the rank's frontend and its forked engine core) and a
    Megatron model; left to float, the quickstart's four busy processes crossed the two cores at every
    step. One core per rank and its engine, 7 alternating pairs of quickstarts (2026-11-28): the step 175-222
    -> 161-205 ms (shorter in 6 pairs, by 7% in the median one), generation 80-104 -> 71-92 ms, the weight
    sync 8.3-11.1 -> 6.5-8.7 ms. Nothing else (the driver, Ray's services, reward workers) is bound. Linux
    only; `resources.bind_cpus=false` turns it off."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpu_share(cpus, local_rank, local_size)
    if share == cpus:  # one rank, or one CPU: nothing to keep to
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), share)
        except OSError:  # a thread that ended meanwhile
            pass


def build_engine(cfg, role: str, *, first: bool, value_head: bool = False, hf_path: Optional[str] = None):
    """The role's MegatronEngine on its own process groups (collective: every process calls it)."""
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups, init_global_state

    role_cfg = getattr(cfg, role)
    with device_mode():
        groups = build_role_groups(role_cfg.layout)
        if first:
            init_global_state(groups, seed=role_cfg.seed)
        return MegatronEngine(hf_path or cfg.model.hf_path, role_cfg, groups, value_head=value_head)


class EngineRole:
    """A role holding one Megatron engine: its call boundary, checkpoints and export.

    `offload`: the engine's parameters (grads, optimizer state) live in host memory between calls.
    """

    name = "role"

    def __init__(self, engine, offload: bool = False):
        self.engine, self.offload = engine, offload

    def publish(self) -> None:
        """Register in this process (`local_role`) and offload when configured (built on the device)."""
        register_local(self.name, self)
        if self.offload:
            self.engine.offload()

    @contextlib.contextmanager
    def resident(self):
        """The engine on its device for the duration (onload/offload around it when offloaded; those two
        run megatron code, so in the device mode, which the block itself need not be in)."""
        if not self.offload:
            yield
            return
        with device_mode():
            self.engine.onload()
        try:
            yield
        finally:
            with device_mode():
                self.engine.offload()

    @contextlib.contextmanager
    def boundary(self):
        """What every call from the driver runs inside: device mode + residency."""
        with device_mode(), self.resident():
            yield

    @remote(ALL)
    def save_checkpoint(self, path: str, wait: bool = True, reshardable: bool = True) -> dict:
        """Model, optimizer, scheduler, RNG and step to `path` (collective over the world); `wait=False`
        returns once the state is copied and `finish_checkpoint` publishes it after its files are written;
        `reshardable=False` keeps the optimizer state DP-sharded (fast; same TP/PP/VPP/CP/EP to load)."""
        return self.engine.save_checkpoint(path, overwrite=True, wait=wait, reshardable=reshardable)

    @remote(ALL)
    def finish_checkpoint(self, wait: bool = True) -> bool:
        """Publish the checkpoint still being written, if any (collective): True once none is in flight."""
        return self.engine.finish_checkpoint(wait=wait)

    @remote(ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Resume from `save_checkpoint`'s directory at this role's layout."""
        return self.engine.load_checkpoint(path)

    @remote(ALL)
    def export_hf(self, path: str) -> dict:
        """The model as an HF safetensors checkpoint."""
        return self.engine.export_hf(path, overwrite=True)
