"""init_ray on a local machine: no idle Python workers started for nothing (each imports Ray; on 2 cores
they competed with the start-up that needs the CPU). Each case starts its own Ray in a child process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, time, psutil, ray
    from megarl.config import load_config
    from megarl.controller import init_ray

    init_ray(load_config("configs/grpo_quickstart.yaml"), log_to_driver=False)

    class Host:  # like megarl's worker hosts: an actor with its own runtime_env
        def pid(self):
            return os.getpid()

    host = ray.remote(num_cpus=0)(Host).options(runtime_env={"env_vars": {"MEGARL_PROBE": "1"}}).remote()
    busy = {ray.get(host.pid.remote())}
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    seen, deadline = set(), time.monotonic() + 3.0
    while time.monotonic() < deadline:
        for p in raylet.children(recursive=True):
            try:
                if "default_worker.py" in " ".join(p.cmdline()) or p.cmdline()[:1] == ["ray::IDLE"]:
                    seen.add(p.pid)
            except psutil.Error:
                pass
        time.sleep(0.1)
    print("idle workers", len(seen - busy), flush=True)
    print("auth mode", os.environ.get("RAY_AUTH_MODE"), flush=True)
    ray.shutdown()
""")


def _idle_workers(**env) -> int:
    return _local_ray(**env)[0]


def _local_ray(**env) -> tuple[int, str, str]:
    """Idle workers seen, the driver's RAY_AUTH_MODE after init_ray, and the child's stderr."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_prestart_worker_first_driver", "RAY_AUTH_MODE")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=REPO,
        env={**environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("idle workers")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    auth = next(line for line in proc.stdout.splitlines() if line.startswith("auth mode")).split()[-1]
    return int(lines[-1].split()[-1]), auth, proc.stderr


def test_a_local_ray_starts_no_idle_workers_megarls_actors_could_not_use():
    assert _idle_workers() == 0


def test_a_local_ray_keeps_rays_token_authentication_without_its_start_notice():
    _, auth, stderr = _local_ray()
    assert auth == "token"  # Ray's default for a new local cluster, unchanged
    assert "Token authentication" not in stderr, stderr
    assert "Started a local Ray instance" in stderr  # Ray's other start-up lines still print


def test_the_users_own_ray_setting_wins():
    """RAY_prestart_worker_first_driver set by the user is kept (and shows the check above can see them)."""
    assert _idle_workers(RAY_prestart_worker_first_driver="1") > 0


SHUTDOWN_CHILD = textwrap.dedent("""
    import psutil, ray
    from megarl.config import load_config
    from megarl.controller import init_ray, shutdown_ray

    init_ray(load_config("configs/grpo_quickstart.yaml"), log_to_driver=False)
    started = ray._private.worker._global_node.all_processes
    pids = {kind: [info.process.pid for info in infos] for kind, infos in started.items()}
    monitor = started["monitor"][0].process
    terminated = []
    monitor.terminate = lambda: terminated.append(True)  # Ray's SIGTERM, on which the monitor hangs
    raylet = psutil.Process(pids["raylet"][0])
    agents = raylet.children(recursive=True)
    shutdown_ray()
    shutdown_ray()  # Ray gone: nothing to do
    _, alive = psutil.wait_procs(agents, timeout=10)  # the raylet's agents end after it, on their own
    alive = [p.pid for p in alive]
    alive += [pid for group in pids.values() for pid in group if psutil.pid_exists(pid)
              and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    print("kinds", sorted(pids), "alive", alive, "initialized", ray.is_initialized(),
          "monitor sigterm", bool(terminated), flush=True)
""")


def test_shutdown_ray_stops_every_process_ray_started_without_the_monitors_hang():
    """The autoscaler monitor (started where the user opts out of skipping it) is killed before Ray's shutdown:
    Ray would SIGTERM it after the GCS, and its handler then waits on the gone GCS until Ray's grace period
    ends (1 of the 1.3 s shutdown)."""
    proc = subprocess.run(
        [sys.executable, "-c", SHUTDOWN_CHILD],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "MEGARL_RAY_SERVICES": "all"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("kinds")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    assert "'monitor'" in lines[-1] and "'raylet'" in lines[-1] and "'gcs_server'" in lines[-1], lines[-1]
    assert lines[-1].endswith("alive [] initialized False monitor sigterm False"), lines[-1]


SERVICES_CHILD = textwrap.dedent("""
    import sys, ray
    from megarl.config import load_config
    from megarl.controller import init_ray, shutdown_ray

    init_ray(load_config("configs/grpo_quickstart.yaml"), log_to_driver=sys.argv[1] == "1")
    kinds = sorted(kind for kind, infos in ray._private.worker._global_node.all_processes.items() if infos)
    answer = ray.get(ray.remote(lambda: 41 + 1).remote())
    print("kinds", " ".join(kinds), "answer", answer, flush=True)
    shutdown_ray()
""")


def _services(log_to_driver: bool, **env) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", SERVICES_CHILD, "1" if log_to_driver else "0"],
        cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k != "MEGARL_RAY_SERVICES"}, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("kinds")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    assert lines[-1].endswith("answer 42"), lines[-1]  # the cluster runs tasks either way
    return lines[-1]


def test_a_local_ray_starts_without_the_autoscaler_and_without_a_log_monitor_nobody_reads():
    quiet = _services(log_to_driver=False)
    assert "gcs_server" in quiet and "raylet" in quiet and "dashboard" in quiet, quiet
    assert "monitor" not in quiet.split() and "log_monitor" not in quiet, quiet
    forwarded = _services(log_to_driver=True)  # worker output goes to the driver: its log monitor stays
    assert "log_monitor" in forwarded and "monitor" not in forwarded.split(), forwarded
    everything = _services(log_to_driver=False, MEGARL_RAY_SERVICES="all")  # the opt-out: Ray's own start
    assert "monitor" in everything.split() and "log_monitor" in everything, everything
