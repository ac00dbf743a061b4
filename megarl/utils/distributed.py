"""Run a function on N local ranks: `run_distributed(fn, world_size, *args)`, and torchrun helpers.

Used by the SPMD tools (conversion, parity) when started as a single process, and by the tests.
Each rank is a fresh process (start method "forkserver" by default on CPU, "spawn" with CUDA; "fork" in a
child of the rank server, `rank_server.run_in_server`, which has the server's imports and no thread) with
MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK set, the process group
initialised (gloo on CPU, NCCL on GPU), `torch.set_num_threads(num_threads)` when given and
`megatron_patches.apply_cpu_patches()` applied (a no-op with CUDA). `fn(*args, **kwargs)` runs on
every rank; the parent gets the list of return values ordered by rank (they must be picklable).
An exception on any rank is re-raised in the parent as `RankError` naming the rank and carrying
its traceback; ranks still running after `timeout` seconds (or a few seconds after another rank
failed) are killed.

`fn` must be importable by name in a fresh process: define it at module top level, not as a
lambda or closure. With forkserver, env variables a module reads at import time are those of the
first call, or of `rank_server.start_early` where a command started the server before it (the server
preloads `rank_server.PRELOAD` once); use start_method="spawn" otherwise.
With CUDA the default is "spawn": a process forked from one that has asked CUDA anything cannot use it
("Cannot re-initialize CUDA in forked subprocess"), and importing megatron.core in the forkserver asks
(`torch.cuda.is_available()` in its dist_checkpointing, which poisons fork; seen on an H200: every
forked rank failed in `torch.cuda.set_device`).

Owns: process launch, rendezvous, result/exception transport. Must not import megatron at module
level (apply_cpu_patches imports it inside the ranks).
"""

from __future__ import annotations

import gc
import io
import os
import queue
import random
import socket
import time
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp

from megarl.utils import rank_server
from megarl.utils.errors import RankError

# Seconds the parent waits for the other ranks once one rank has failed (they are usually stuck
# in a collective waiting for it).
FAILURE_GRACE_S = 5.0


# Ports `free_port` draws from when the OS's ephemeral range is known: below that range.
_LOW_PORT = 10000
_handed_out: set[int] = set()
"""Ports `free_port` returned in this process: a port handed out but not bound yet is free to a second draw."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, drawn below the OS's ephemeral port range.

    The caller binds it later (a rank's store, often seconds later). A port from the ephemeral range
    (what binding port 0 returns) can be taken in between by any socket the OS numbers itself: gloo's
    pair connections, every outgoing connection. Below the range only another explicit bind can take it.
    Falls back to an ephemeral port where the range cannot be read (not Linux). Never returns a port it
    returned before in this process (two draws before either is bound once gave the same one: a benchmark's
    weight group and its ranks' store, EADDRINUSE).
    """
    low, _ = _ephemeral_range()
    candidates = random.SystemRandom().sample(range(_LOW_PORT, low), min(64, max(low - _LOW_PORT, 0)))
    for port in candidates:
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """(first, last) port the OS numbers outgoing and port-0 sockets from; (_LOW_PORT, 65535) if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return _LOW_PORT, 65535


def in_launched_world() -> bool:
    """True when started by torchrun / srun with the usual env variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_process_group_from_env() -> None:
    """Initialise torch.distributed from the env (idempotent): NCCL and the local GPU when CUDA exists, else gloo."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _dumps(value: Any) -> bytes:
    """Serialise a rank's result in the rank, so a bad value fails there with a traceback.

    torch.save, not pickle: tensors go by value (torch's shared-memory queue reductions break when
    a rank exits before the parent reads), and storages do not reference
    megatron.core.safe_globals (importing megatron.core changes how plain pickle writes them,
    which would make the parent import megatron, ~5 s, to read a result).
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _rank_entry(fn, rank, world_size, port, env, num_threads, apply_patches, args, kwargs, results):
    import torch.distributed as dist

    # The objects a forked rank inherits (the server's imports: torch, megatron-core, transformers; ~340k) stay
    # out of its garbage collections: a full collection walks every tracked object and writes to its header,
    # which copies each page the rank shares with the server. In a conversion rank that was 0.2 s of a 0.32 s
    # model build (profiled under Module.__setattr__, where the collection happened to run).
    gc.freeze()
    ok = False
    try:
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
        if num_threads:
            torch.set_num_threads(num_threads)
        if apply_patches:
            from megatron_patches import apply_cpu_patches

            apply_cpu_patches()
        init_process_group_from_env()
        payload = _dumps(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        # Report before tearing the group down: peers then fail with "connection closed", and the
        # parent should see this rank's error first.
        results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    else:
        results.put((rank, True, payload))
        ok = True
    finally:
        if dist.is_initialized():
            _wait_for_peers(rank, world_size, wait=ok)
            dist.destroy_process_group()


_DONE_KEY = "megarl/run_distributed/done"


def _wait_for_peers(rank: int, world_size: int, wait: bool) -> None:
    """Rank 0 hosts the rendezvous store: it stays until every rank is done with it.

    Ranks still creating a group they alone belong to use the store (a rank-1 reward model after rank 0
    had returned: gloo's `new_group` on rank 1 failed with "Connection reset by peer" once rank 0's
    process, and its store, were gone). Every rank counts itself done; rank 0 waits for the count while
    its parent lives (the parent kills stuck ranks after a failure or its timeout). A failed rank 0 does
    not wait: its peers may be blocked in a collective with it, and tearing its group down releases them.
    """
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        done = store.add(_DONE_KEY, 1)
        parent = os.getppid()
        while wait and rank == 0 and done < world_size and os.getppid() == parent:
            time.sleep(0.01)
            done = store.add(_DONE_KEY, 0)
    except Exception:  # noqa: BLE001 - a peer's store already gone: nothing left to wait for
        pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: Optional[float] = None,
    num_threads: Optional[int] = None,
    apply_patches: bool = True,
    start_method: Optional[str] = None,
    **kwargs: Any,
) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks (gloo, or NCCL with CUDA); return the per-rank results.

    `start_method` None: "spawn" where CUDA is available, else "fork" in a rank server's child, else
    "forkserver" (module docstring).

    Raises RankError (the failing rank, with its traceback) if a rank raises or dies
    without reporting (exc_type "ProcessDied"), TimeoutError after `timeout` seconds (None: no limit).
    """
    if start_method is None:
        start_method = (
            "spawn" if torch.cuda.is_available() else "fork" if rank_server.in_server_child() else "forkserver"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Effective only before the server starts (the first forkserver call of this process).
        ctx.set_forkserver_preload(rank_server.PRELOAD)
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_entry,
            name=f"rank{rank}",
            daemon=False,
            args=(fn, rank, world_size, port, env, num_threads, apply_patches, args, kwargs, results),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    finished = False
    try:
        values = _collect(procs, results, world_size, timeout)
        finished = True
        return values
    except KeyboardInterrupt:  # Ctrl-C reached the ranks too: they remove what they staged before they go
        finished = True  # (killed at once, a rank left its conversion's staging directory behind)
        raise
    finally:
        _stop(procs, grace=2.0 if finished else 0.0)
        results.close()


def _collect(procs, results, world_size: int, timeout: float) -> List[Any]:
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    values: dict[int, Any] = {}
    failures: list[RankError] = []
    failure = None  # (first failure, when it arrived)
    while len(values) < world_size:
        if failure is not None:
            deadline = min(deadline, failure[1] + FAILURE_GRACE_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if proc.exitcode not in (None, 0) and rank not in values:
                    values[rank] = None
                    failures.append(
                        RankError(rank, "ProcessDied", f"exit code {proc.exitcode} before reporting a result", "")
                    )
                    failure = failure or (failures[-1], time.monotonic())
            continue
        if ok:
            values[rank] = _loads(payload)
            continue
        values[rank] = None
        failures.append(RankError(rank, *payload))
        if failure is None:
            failure = (failures[0], time.monotonic())
    if failure is not None:
        raise _root_cause(failures)
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise TimeoutError(f"run_distributed: ranks {missing} did not finish within {timeout:.0f} s (killed)")
    return [values[r] for r in range(world_size)]


_PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport")


def _root_cause(failures: List[RankError]) -> RankError:
    """The failure to report: the first one that is not just a peer noticing another rank died."""
    primary = next((f for f in failures if not any(m in f.remote_message for m in _PEER_LOSS_MARKERS)), failures[0])
    others = sorted(f.rank for f in failures if f is not primary)
    if others:
        primary.args = (primary.args[0] + f"\n(ranks {others} failed too)",)
    return primary


def _stop(procs, grace: float) -> None:
    """Join ranks that are exiting on their own (up to `grace` s), then kill the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
