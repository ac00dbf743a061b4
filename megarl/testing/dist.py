"""Run a function on N gloo ranks from pytest: `run_distributed(fn, world_size, *args)`.

Each rank is a fresh process (start method "spawn" by default, "forkserver" allowed) with
MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK set,
`torch.distributed.init_process_group("gloo")` done, `torch.set_num_threads(num_threads)` and
`megatron_patches.apply_cpu_patches()` applied. `fn(*args, **kwargs)` runs on every rank; the
parent gets the list of return values ordered by rank (they must be picklable). An exception on
any rank is re-raised in the parent as `DistributedTestError` naming the rank and carrying its
traceback; ranks still running after `timeout` seconds (or a few seconds after another rank
failed) are killed.

`fn` must be importable by name in a fresh process: define it at module top level (a test module
or megarl), not as a lambda or closure. `dist_checkpointing.save` starts a spawn-mode
multiprocessing manager inside the ranks, which needs the same.

Owns: process launch, rendezvous, result/exception transport. Must not import megatron at module
level (apply_cpu_patches imports it inside the ranks).
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp

# Seconds the parent waits for the other ranks once one rank has failed (they are usually stuck
# in a collective waiting for it).
FAILURE_GRACE_S = 5.0


class DistributedTestError(RuntimeError):
    """An exception raised on one rank of run_distributed, with that rank's traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = tb


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, num_threads, apply_patches, args, kwargs, results):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        import torch
        import torch.distributed as dist

        if num_threads:
            torch.set_num_threads(num_threads)
        if apply_patches:
            from megatron_patches import apply_cpu_patches

            apply_cpu_patches()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(*args, **kwargs)
            pickle.dumps(value)  # fail here, with a traceback, rather than in the queue's thread
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    num_threads: int = 1,
    apply_patches: bool = True,
    start_method: str = "spawn",
    **kwargs: Any,
) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.

    Raises DistributedTestError (first failing rank, with its traceback) if a rank raises,
    RuntimeError if a rank dies without reporting, TimeoutError after `timeout` seconds.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, name=f"rank{rank}", daemon=False,
                    args=(fn, rank, world_size, port, num_threads, apply_patches, args, kwargs, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        _kill(procs)
        results.close()


def _collect(procs, results, world_size: int, timeout: float) -> List[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failure = None
    while len(values) < world_size:
        if failure is not None:
            deadline = min(deadline, failure[1] + FAILURE_GRACE_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
            if dead and failure is None:
                rank = dead[0]
                failure = (DistributedTestError(rank, "ProcessDied",
                           f"exit code {procs[rank].exitcode} before reporting a result", ""),
                           time.monotonic())
            continue
        if ok:
            values[rank] = payload
        elif failure is None:
            failure = (DistributedTestError(rank, *payload), time.monotonic())
        else:
            values[rank] = None  # a later failure on another rank; the first one is reported
    if failure is not None:
        raise failure[0]
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise TimeoutError(f"run_distributed: ranks {missing} did not finish within {timeout:.0f} s "
                           f"(killed)")
    return [values[r] for r in range(world_size)]


def _kill(procs) -> None:
    for proc in procs:
        proc.join(timeout=2.0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
