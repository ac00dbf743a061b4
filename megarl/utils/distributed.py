"""Starting gloo/NCCL worlds for the SPMD tools (conversion, parity, evaluation).

Owns: `in_launched_world` (are we under torchrun?), `init_process_group_from_env`, and `spawn`,
which runs a function on N local ranks when a tool is started as a single process. Megatron's
model-parallel state is initialised by the callers (`megarl.models.runtime`).
"""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def in_launched_world() -> bool:
    """True when started by torchrun / srun with the usual env variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group_from_env() -> None:
    """Initialise torch.distributed from torchrun's env (idempotent); pins the local GPU when present."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        init_process_group_from_env()
        results[rank] = ("ok", fn(*args))
    except BaseException as err:  # reported to the parent, which re-raises
        results[rank] = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class SpawnError(RuntimeError):
    """A spawned rank failed; the message carries its rank and traceback."""


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks (spawned processes) and return every rank's result."""
    with mp.get_context("spawn").Manager() as manager:
        shared = manager.dict()
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), fn, args, shared), nprocs=world_size,
                               join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the failing rank's traceback is in `shared`
        results = dict(shared)
    failures = {r: v[1] for r, v in results.items() if v[0] == "error"}
    if failures or len(results) < world_size:
        rank = min(failures, default="?")
        raise SpawnError(f"rank {rank} of {world_size} failed:\n{failures.get(rank, 'exited without a result')}")
    return [results[r][1] for r in range(world_size)]
