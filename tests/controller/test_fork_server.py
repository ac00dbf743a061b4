"""Ray workers forked from megarl's fork server (`megarl.controller.fork_server`): the actor runs in a child of
the server with the preloaded modules already imported, under its own runtime_env; killing it leaves nothing
behind; a launcher without a server, or a server whose preload imported Ray, starts a plain worker; the
server dies with the process that started it. One local Ray for the module (a child process per case would
start Ray again each time)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")
from megarl.controller.fork_server import ForkServer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PRELOADED = "tabnanny"  # a module neither Ray's worker nor the probe imports itself


def _probe_class(preloaded: str = PRELOADED):
    class Probe:  # defined here: Ray ships it by value (the test module is not importable in a worker)
        def info(self) -> dict:
            import gc
            import os
            import sys

            return {
                "frozen": gc.get_freeze_count(),
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "pgid": os.getpgid(0),
                "preloaded": preloaded in sys.modules,
                "env": os.environ.get("MEGARL_PROBE"),
            }

    return Probe


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _probe(py_executable: str, **env):
    runtime_env = {"py_executable": py_executable, "env_vars": {"MEGARL_PROBE": "1", **env}}
    actor = ray.remote(num_cpus=0)(_probe_class()).options(runtime_env=runtime_env).remote()
    return actor, ray.get(actor.info.remote(), timeout=90)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_a_worker_is_forked_from_the_server_with_its_preload_and_its_own_environment(local_ray):
    server = ForkServer.start([PRELOADED])
    try:
        actor, info = _probe(server.py_executable)
        assert info["ppid"] == server.proc.pid and info["preloaded"] and info["env"] == "1"
        assert info["frozen"] > 0  # the preloaded objects stay out of the worker's garbage collections
        assert info["pgid"] == info["pid"]  # a group of its own, like any Ray worker
        ray.kill(actor)
        assert _gone(info["pid"])
    finally:
        server.stop()
    assert not os.path.exists(server.path)


def test_the_worker_dies_with_its_launcher(local_ray):
    server = ForkServer.start([PRELOADED])
    try:
        actor, info = _probe(server.py_executable)
        launchers = [
            p for p in psutil.process_iter(["cmdline"]) if "fork_launch.py" in " ".join(p.info["cmdline"] or [])
        ]
        assert launchers, "no launcher process"
        for launcher in launchers:
            launcher.kill()  # what the raylet does to a worker it gives up on
        assert _gone(info["pid"])
    finally:
        server.stop()


def test_without_a_server_the_launcher_runs_a_plain_worker(local_ray):
    server = ForkServer.start([PRELOADED])
    server.stop()  # its socket is gone: the launcher cannot connect
    _, info = _probe(server.py_executable)
    assert not info["preloaded"] and info["env"] == "1"
    assert psutil.Process(info["pid"]).cmdline()[1:2] != ["-P"]  # not the launcher: it exec'd the plain worker


def test_a_server_whose_preload_imported_ray_serves_nothing(local_ray):
    server = ForkServer.start([PRELOADED, "ray"])  # a Ray imported before the cluster's token and job ids exist
    try:
        _, info = _probe(server.py_executable)
        assert info["ppid"] != server.proc.pid and not info["preloaded"]
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_the_server_dies_with_the_process_that_started_it():
    script = textwrap.dedent(f"""
        import time
        from megarl.controller.fork_server import ForkServer
        server = ForkServer.start([{PRELOADED!r}])
        print(server.proc.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _gone(server_pid, timeout=5.0)
