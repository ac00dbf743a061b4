"""From a validated config to Ray: which roles share which pool's processes, each role's rank mesh,
and how to start or join the Ray cluster.

Owns: `plan_placement(cfg)` (pool -> roles built in its workers, in build order; a colocated
rollout engine sits in the actor's pool), `role_mesh(cfg, role)`, `init_ray(cfg)` and `shutdown_ray()`.
Pure Python except `init_ray` / `shutdown_ray` (import Ray when called).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from megarl.config.validate import Derived, derive
from megarl.controller.dispatch import RankMesh


def plan_placement(cfg, derived: Optional[Derived] = None) -> dict[str, list[str]]:
    """{pool: [roles]}: every active model role in its configured pool, plus "rollout" in its pool."""
    derived = derived or derive(cfg)
    plan: dict[str, list[str]] = {name: [] for name in derived.pool_gpus}
    for role in derived.roles:
        plan[getattr(cfg, role).pool].append(role)
    plan[cfg.rollout.pool].append("rollout")
    return {pool: roles for pool, roles in plan.items() if roles}


def role_mesh(cfg, role: str, derived: Optional[Derived] = None) -> RankMesh:
    """The rank mesh of a model role over its whole pool (the role spans every worker of its pool)."""
    derived = derived or derive(cfg)
    if role not in derived.roles:
        raise ValueError(f"role {role!r} is not active in this config; active: {list(derived.roles)}")
    return RankMesh(getattr(cfg, role).layout, derived.role_world[role])


def local_ray_resources(cfg) -> dict:
    """`ray.init` arguments for a single-machine run sized for the config's pools."""
    res = cfg.resources
    workers = sum(derive(cfg).pool_gpus.values())
    kwargs = {"num_cpus": max(os.cpu_count() or 1, int(workers * res.cpus_per_worker + 0.999))}
    if res.accelerator == "cpu":
        kwargs["num_gpus"] = 0
    return kwargs


def init_ray(cfg, **overrides) -> None:
    """Join `resources.ray_address` (e.g. the sbatch script's cluster), or start a local Ray for the config."""
    import ray

    if ray.is_initialized():
        return
    from megarl.utils.interrupts import reclaim_signals

    common = {"include_dashboard": False, "log_to_driver": True, **overrides}
    if cfg.resources.ray_address:
        ray.init(address=cfg.resources.ray_address, **common)
    else:
        # Ray prestarts idle workers for the first driver; megarl's actors each carry their own
        # runtime_env, so none can ever run in one: they import Ray (0.5-0.8 s of CPU each, measured) and
        # exit, while the start-up needs those cores. Read by the raylet ray.init starts; a user's value wins.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        with _token_notice_dropped(), _head_without_idle_services(common):
            ray.init(**local_ray_resources(cfg), **common)
    reclaim_signals()  # Ray's own SIGTERM handler would exit at once (134), without the graceful stop


@contextlib.contextmanager
def _token_notice_dropped():
    """Ray (2.60) turns token authentication on for every new local cluster, which megarl keeps, and says so
    in a warning on every start ("Token authentication is enabled for this Ray cluster. Set
    RAY_AUTH_MODE=disabled to opt out"): a line that asks nothing of a `megarl train` user. Dropped here;
    `RAY_AUTH_MODE` set by the user is Ray's to honour, silently, as before."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")

    def not_the_notice(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")

    logger.addFilter(not_the_notice)
    try:
        yield
    finally:
        logger.removeFilter(not_the_notice)


@contextlib.contextmanager
def _head_without_idle_services(options: dict):
    """While a local Ray starts, its head skips two Python services a megarl run does not use.

    What: `ray._private.node.Node.start_monitor` (the autoscaler: nothing to scale on one machine, and
      `shutdown_ray` kills it before Ray stops) and, when no worker output goes to the driver
      (`log_to_driver=False`), `start_log_monitor` (it only forwards that output; the files stay in the session
      directory) are no-ops during `ray.init`.
    Why: each is a Python process importing Ray (~0.4 s of CPU each) while the workers' imports and Ray's own
      start need the quickstart's two cores: its workers were ready in 5.3-6.3 s (mean 5.65) without them
      against 5.7-7.5 s (mean 6.71) with them (8 pairs, alternating; 4 earlier pairs showed no difference).
    Kept: the GCS, the raylet and its agents, the dashboard's API server (with it gone the dashboard agent logs
      an error every second looking for it). A Ray whose `Node` lacks these methods starts them as before.
    Verified on: Ray 2.60 (tests/controller/test_init_ray.py). Opt out: MEGARL_RAY_SERVICES=all.
    """
    from ray._private import node

    skipped = ["start_monitor"] + (["start_log_monitor"] if options.get("log_to_driver") is False else [])
    if os.environ.get("MEGARL_RAY_SERVICES") == "all" or not all(hasattr(node.Node, n) for n in skipped):
        yield
        return
    original = {name: getattr(node.Node, name) for name in skipped}
    for name in skipped:
        setattr(node.Node, name, lambda self: None)
    try:
        yield
    finally:
        for name, method in original.items():
            setattr(node.Node, name, method)


def shutdown_ray() -> None:
    """`ray.shutdown()`, without its two waits: a local Ray's autoscaler monitor, where one was started
    (`MEGARL_RAY_SERVICES=all`, `_head_without_idle_services`), is killed first, and the call is not Ray's
    atexit one (that one sleeps 0.5 s for worker logs still printing).

    Ray stops the monitor after the GCS; on SIGTERM the monitor reports its end to the GCS that is gone
    and hangs until Ray's 1 s grace period ends in SIGKILL (Ray 2.60: 1.0 of a 1.3 s shutdown). A monitor
    has nothing to scale on the one machine of a local Ray. Only processes this driver started are touched
    (`_global_node.all_processes`, Ray's private record of them; a driver that joined a cluster started none)."""
    import ray

    if not ray.is_initialized():
        return
    node = getattr(ray._private.worker, "_global_node", None)
    for info in (getattr(node, "all_processes", None) or {}).get("monitor", []):
        with contextlib.suppress(Exception):  # already gone, or Ray's internals changed: Ray stops it
            info.process.kill()
            info.process.wait(timeout=5)
    ray.shutdown()
