"""Worker groups: one Ray actor per rank of a resource pool, holding the role objects of that rank.

Owns: `WorkerGroup` and its actor body `WorkerHost`. A host process gets its torch.distributed
rendezvous environment (MASTER_ADDR/PORT of rank 0's node, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, and CUDA_VISIBLE_DEVICES listing the GPUs Ray gave the ranks of its node, so
LOCAL_RANK indexes its own GPU) *before* any role object is built in it. Roles are composed, not
flagged: `add_role("actor", ActorWorker, cfg)` builds an `ActorWorker` in every host; a second
`add_role("critic", ...)` on the same group colocates the critic in the same processes (each role
keeps its own process groups); a role on another pool gets its own `WorkerGroup`.

The driver calls a role through its typed handle, `RoleHandle` (what `megarl.controller.cluster`
hands the loop as `cluster.actor`, `cluster.critic`, ...): `cluster.actor.compute_log_probs(batch)`
runs `Actor.compute_log_probs` on the role's ranks as its `@remote` mark says
(`megarl.utils.remote`: rows split over DP ranks and merged back, or every rank). Underneath, calls
name the role and the method and return Ray futures:

    refs = group.execute_all("actor.save_checkpoint", path)  # every rank, same arguments
    call = group.dispatch("actor.compute_log_probs", batch, mesh)   # DP shards -> ranks
    log_probs = group.collect(call)                          # first TP rank, last PP stage, CP 0

A host runs every call inside the role's `boundary()` when it has one (for engine roles: megatron's
device mode and offload residency, `megarl.workers.base.EngineRole`). Calls run one at a time on
one thread (Ray's default concurrency group), except those sent to `REQUEST_GROUP`, a concurrency
group of `REQUEST_CONCURRENCY` threads for per-request rollout calls (a colocated engine serves
many requests at once; the driver never overlaps them with training calls).
Imports Ray lazily (the module imports without it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence, TypeVar, cast

from megarl.controller.dispatch import DPSplit, RankMesh
from megarl.controller.resource_pool import ResourcePool
from megarl.data.batch import Batch
from megarl.utils.remote import ALL, METRICS, ROWS, remote_methods

R = TypeVar("R")
REQUEST_GROUP = "requests"
"""The worker host's concurrency group for per-request calls (`rollout.generate` of one request, `rollout.abort`):
call `worker.call.options(concurrency_group=REQUEST_GROUP).remote(...)`. Every other call runs in the
default group, one at a time on one thread, exactly as without the group."""
REQUEST_CONCURRENCY = 128
"""Threads of the request group: requests one worker host serves at once (each call blocks a thread)."""


class WorkerError(RuntimeError):
    """A role method raised (or its worker died) on some rank; names the group, rank and call."""

    def __init__(self, group: str, rank: int, cause: BaseException, failed_ranks: list[int]):
        self.group, self.rank, self.cause, self.failed_ranks = group, rank, cause, failed_ranks
        others = f" (also failed: ranks {failed_ranks[1:]})" if len(failed_ranks) > 1 else ""
        super().__init__(f"group {group!r} rank {rank}: {type(cause).__name__}: {cause}{others}")


class WorkerHost:
    """The body of every worker actor: rendezvous env, then role objects addressed by name."""

    def __init__(self):
        self._roles: dict[str, Any] = {}

    def node_info(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def get_env(self, keys: Sequence[str]) -> dict[str, Optional[str]]:
        return {k: os.environ.get(k) for k in keys}

    def add_role(self, name: str, cls: type, args: tuple, kwargs: dict) -> None:
        if name in self._roles:
            raise ValueError(f"role {name!r} already exists in this worker")
        self._roles[name] = cls(*args, **kwargs)

    def roles(self) -> list[str]:
        return list(self._roles)

    def call(self, target: str, *args, **kwargs) -> Any:
        """`role.method(*args, **kwargs)` (arguments are top-level so Ray resolves object refs in them)."""
        role, _, method = target.rpartition(".")
        if role not in self._roles:
            raise ValueError(f"{target!r}: no role {role!r} in this worker; roles: {list(self._roles)}")
        obj = self._roles[role]
        boundary = getattr(obj, "boundary", contextlib.nullcontext)
        with boundary():
            return getattr(obj, method)(*args, **kwargs)


@dataclass
class DPCall:
    """An in-flight dispatched call: the futures of every rank and how to reassemble their results."""

    refs: list
    """One future per rank of the group."""
    split: DPSplit
    """The DP split of the input rows."""
    mesh: RankMesh
    """The role's rank mesh (which ranks to read results from)."""


class WorkerGroup:
    """`pool.world_size` WorkerHost actors, rank r in the pool's bundle of slot r."""

    def __init__(self, pool: ResourcePool, *, name: Optional[str] = None, env: Optional[dict[str, str]] = None):
        import ray

        self.pool, self.name = pool, name or pool.name
        self.slots = pool.slots()
        # training calls keep the default group (one thread, in order, as the driver issues them);
        # per-request rollout calls run in their own group, many at once (`REQUEST_GROUP`)
        host_cls = ray.remote(concurrency_groups={REQUEST_GROUP: REQUEST_CONCURRENCY})(WorkerHost)
        runtime_env = {"env_vars": dict(env)} if env else None
        self.workers = [
            host_cls.options(name=None, runtime_env=runtime_env, **pool.actor_options(slot)).remote()
            for slot in self.slots
        ]
        self.env = self._rendezvous()

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _rendezvous(self) -> list[dict[str, str]]:
        """Set each rank's distributed env; returns it per rank (also kept as `self.env`)."""
        import ray

        infos = ray.get([w.node_info.remote() for w in self.workers])
        master_addr, master_port = infos[0]["ip"], ray.get(self.workers[0].free_port.remote())
        envs = [self._rank_env(slot, infos, master_addr, master_port) for slot in self.slots]
        ray.get([w.set_env.remote(e) for w, e in zip(self.workers, envs)])
        return envs

    def _rank_env(self, slot, infos, master_addr: str, master_port: int) -> dict[str, str]:
        env = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_WORLD_SIZE": str(slot.local_world_size),
            "MEGARL_WORKER_GROUP": self.name,
        }
        if self.pool.use_gpu:
            node_gpus = [infos[s.rank]["gpu_ids"][0] for s in self.slots if s.bundle == slot.bundle]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)  # LOCAL_RANK indexes this rank's own GPU
        return env

    # ---- roles and calls ------------------------------------------------------------------------

    def add_role(self, name: str, cls: type, *args, **kwargs) -> None:
        """Build `cls(*args, **kwargs)` as role `name` in every worker (blocks; `WorkerError` names the rank)."""
        if "." in name:
            raise ValueError(f"role name {name!r} must not contain '.' (calls are 'role.method')")
        self.get([w.add_role.remote(name, cls, args, kwargs) for w in self.workers])

    def execute_all(self, target: str, *args, **kwargs) -> list:
        """`role.method(*args, **kwargs)` on every rank; one future per rank."""
        import ray

        args, kwargs = _put_once(args, kwargs, ray)
        return [w.call.remote(target, *args, **kwargs) for w in self.workers]

    def execute_rank(self, rank: int, target: str, *args, **kwargs):
        """`role.method(...)` on one rank; its future."""
        return self.workers[rank].call.remote(target, *args, **kwargs)

    def execute_rank0(self, target: str, *args, **kwargs):
        return self.execute_rank(0, target, *args, **kwargs)

    def execute_per_rank(self, target: str, per_rank_args: Sequence[tuple]) -> list:
        """`role.method(*per_rank_args[r])` on rank r."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{len(per_rank_args)} argument tuples for {self.world_size} ranks")
        return [w.call.remote(target, *a) for w, a in zip(self.workers, per_rank_args)]

    def dispatch(
        self,
        target: str,
        batch: Batch,
        mesh: RankMesh,
        *,
        balance: bool = True,
        group_key: Optional[str] = None,
        **kwargs,
    ) -> DPCall:
        """Split `batch` over the mesh's DP ranks (token-balanced) and call `target(shard, **kwargs)` on every rank."""
        import ray

        if mesh.world_size != self.world_size:
            raise ValueError(f"{mesh} spans {mesh.world_size} ranks but group {self.name!r} has {self.world_size}")
        split = DPSplit.of(batch, mesh.dp_size, balance=balance, group_key=group_key)
        # A shard shared by TP/PP/CP peers is put once; a shard for one rank goes by value: Ray inlines a small
        # one in the call and stores a large one as ray.put would (a put of the quickstart's 49 KB cost 0.8 ms).
        one_rank_each = mesh.world_size == mesh.dp_size
        shards = split.shards if one_rank_each else [ray.put(shard) for shard in split.shards]
        refs = [w.call.remote(target, shards[c.dp], **kwargs) for w, c in zip(self.workers, mesh.coords)]
        return DPCall(refs=refs, split=split, mesh=mesh)

    def collect(self, call: DPCall, timeout: Optional[float] = None) -> Batch:
        """The results of the collecting ranks (one per DP index) merged back into input row order.

        Waits for every rank (so errors of non-collecting ranks surface too).
        """
        results = self.get(call.refs, timeout=timeout)
        return call.split.restore([_as_batch(results[r]) for r in call.mesh.collect_ranks()])

    def get(self, refs: list, timeout: Optional[float] = None) -> list:
        """Results of per-rank futures (index = rank); `WorkerError` names the lowest failing rank.

        Unlike `ray.get`, which raises whichever error arrives first, this waits for every rank so
        the reported error is deterministic and the others are listed.
        """
        import ray

        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            raise TimeoutError(
                f"group {self.name!r}: {len(pending)} of {len(refs)} ranks did not answer within {timeout} s"
            )
        results, failed = [], []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                failed.append((rank, getattr(err, "cause", None) or err))
                results.append(None)
        if failed:
            raise WorkerError(self.name, failed[0][0], failed[0][1], [r for r, _ in failed]) from failed[0][1]
        return results

    def shutdown(self) -> None:
        """Kill the workers and release the pool's placement group."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.pool.remove()


class RoleHandle:
    """The driver's handle on one role of a worker group: the role class's `@remote` methods, each
    called the way its mark says (see `megarl.utils.remote`). Build it with `role_handle`."""

    def __init__(self, group: WorkerGroup, name: str, cls: type, mesh: RankMesh):
        self.group, self.name, self.cls, self.mesh = group, name, cls, mesh
        self.methods = remote_methods(cls)

    def __getattr__(self, method: str):
        if method.startswith("__") or "methods" not in self.__dict__:
            raise AttributeError(method)
        mode = self.methods.get(method)
        if mode is None:
            raise AttributeError(
                f"{self.cls.__name__}.{method} is not a remote method of role {self.name!r};"
                f" remote methods: {sorted(self.methods)}"
            )
        return functools.update_wrapper(functools.partial(self._call, method, mode), getattr(self.cls, method))

    def _call(self, method: str, mode: str, *args, **kwargs):
        target, group = f"{self.name}.{method}", self.group
        if mode == ALL:
            return group.get(group.execute_all(target, *args, **kwargs))[0]
        if len(args) != 1:
            raise TypeError(f"{target} takes the batch as its only positional argument (keywords for the rest)")
        call = group.dispatch(target, args[0], self.mesh, **kwargs)
        if mode == ROWS:
            return group.collect(call)
        assert mode == METRICS
        return group.get(call.refs)[self.mesh.collect_ranks()[0]]

    def __repr__(self) -> str:
        return f"RoleHandle({self.name!r}: {self.cls.__name__} on {self.mesh})"


def role_handle(group: WorkerGroup, name: str, cls: type[R], mesh: RankMesh) -> R:
    """A handle on role `name` (built from `cls` in `group`), typed as `cls` so editors follow its calls."""
    return cast(R, RoleHandle(group, name, cls, mesh))


def _put_once(args: tuple, kwargs: dict, ray) -> tuple[tuple, dict]:
    """Large arguments (Batches) go to the object store once, not once per rank."""
    args = tuple(ray.put(a) if isinstance(a, Batch) else a for a in args)
    kwargs = {k: ray.put(v) if isinstance(v, Batch) else v for k, v in kwargs.items()}
    return args, kwargs


def _as_batch(result: Any) -> Batch:
    if isinstance(result, Batch):
        return result
    if isinstance(result, dict):
        return Batch.from_dict({k: v for k, v in result.items()})
    raise TypeError(
        f"collect() needs a Batch (or dict of row-aligned tensors) from each rank, got {type(result).__name__}"
    )
