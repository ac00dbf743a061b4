"""Worker processes forked from one process that imported torch, megatron-core, transformers (and vLLM) once.

Ray starts every worker from a fresh interpreter, and each imports the same stack again: on the quickstart's
two cores that was ~9 s of CPU per worker, after the driver's checks and `ray.init` had left a core idle for
seconds. For a local CPU run (`resources.fork_workers`, the default), `megarl train` starts this server
first, from the config files' raw values (`start_early`, before the driver imports torch; `confirm` checks it
against the loaded config); it imports the stack on the core the driver's checks leave idle, and Ray's workers
are forked from it:

    server = ForkServer.start(preload_modules(cfg), env)        # the driver, before its checks
    ray.init(runtime_env={"py_executable": server.py_executable})  # Ray's worker command, through the launcher
    ...
    server.stop()                                                # once the workers are stopped

Ray runs `<py_executable> default_worker.py <args>` for each worker. The launcher
(`megarl/controller/fork_launch.py`, standard library only) hands the server that command line, its
environment, working directory and stdin/stdout/stderr; the server forks a child that takes them over and
runs `default_worker.py`; the launcher stays as the process Ray started: it forwards signals to the child,
kills it when the raylet is gone, and exits with the child's exit status. The child dies when its launcher
does. A launcher that cannot reach the server execs the plain Python worker instead.

What a child starts with that a fresh worker would not: modules imported under the server's environment
(the driver's, plus megarl's worker variables), so a variable a module reads at import comes from there;
numpy's global random state is reseeded in each child; the objects it inherits are frozen (`gc.freeze`: its
garbage collections skip them). The server starts no thread before it forks.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from megarl.utils import rank_server

LAUNCHER = Path(__file__).with_name("fork_launch.py")

# Imported by every worker of a run, in this order: what every local rank imports (`rank_server.PRELOAD`:
# torch, `megarl` before megatron-core so its import defers torch.compile, transformers' config machinery),
# then megarl's workers and config.
BASE_PRELOAD = [
    *rank_server.PRELOAD,
    "megarl.workers",
    "megarl.config",  # unpickling the run's config imports it (0.3 s)
]
# Not `vllm.v1.engine.async_llm`: it imports Ray (below, `_preload`). Not `vllm.v1.worker.cpu_worker` (what
# each engine core imports, 2.4 s): the preload is on the start-up's critical path, and with it the workers
# waited that much longer (quickstart, 3 runs: ready in 14.1-15.2 s against 13.1-14.4 s).
VLLM_PRELOAD = ["vllm", "vllm.engine.arg_utils"]


def preload_modules(cfg) -> list[str]:
    """What the run's workers import: the base stack, and vLLM's engine where the rollout engine may be vLLM
    (`auto` picks it where it imports; where it does not, the preload skips it)."""
    return BASE_PRELOAD + (VLLM_PRELOAD if cfg.rollout.engine in ("vllm", "auto") else [])


def start(cfg) -> "ForkServer":
    """The run's server: its workers' modules, imported under their environment (`worker_env`)."""
    return ForkServer.start(*_settings(cfg))


def start_early(files, overrides: Sequence[str]) -> Optional["ForkServer"]:
    """The run's server, started from the raw values of the config files and overrides, before the driver
    imports torch (the typed config imports it; `megarl train`'s first ~3 s): `confirm` checks it against the
    loaded config. None where the raw values do not say (an interpolation in one of them, a file that does not
    read: `load_config` reports that) or the run wants no server."""
    early = _early_config(files, overrides)
    try:
        return start(early) if early is not None and wanted(early) else None
    except (TypeError, ValueError):  # a value of the wrong type: `load_config` names it
        return None


def confirm(server: Optional["ForkServer"], cfg) -> Optional["ForkServer"]:
    """The run's server for the loaded config: `server` (from `start_early`) where it preloads what the config
    asks under the environment it asks, else a new one, or none where the run wants none. A server that does
    not fit is stopped."""
    if server is not None and wanted(cfg) and (server.modules, server.env) == _settings(cfg):
        return server
    if server is not None:
        server.stop()
    return start(cfg) if wanted(cfg) else None


# The schema's defaults of the fields `start_early` reads (a test checks them against `megarl.config.schema`,
# which this module must not import: it imports torch).
EARLY_DEFAULTS = {
    "resources": {"fork_workers": True, "ray_address": None, "accelerator": "gpu", "cpus_per_worker": 1.0},
    "rollout": {"engine": "auto"},
}


def _early_config(files, overrides: Sequence[str]) -> Optional[SimpleNamespace]:
    """`cfg.resources` and `cfg.rollout` as far as `wanted` and `_settings` read them, from the raw tree."""
    from megarl.utils.yaml_tree import ConfigError, read_tree

    try:
        tree = read_tree(files, overrides)
    except ConfigError:
        return None
    sections = {}
    for section, defaults in EARLY_DEFAULTS.items():
        raw = tree.get(section, {})
        if not isinstance(raw, dict):
            return None
        values = {key: raw.get(key, default) for key, default in defaults.items()}
        if any(isinstance(value, str) and "${" in value for value in values.values()):
            return None
        sections[section] = SimpleNamespace(**values)
    return SimpleNamespace(**sections)


def _settings(cfg) -> tuple[list[str], dict[str, str]]:
    from megarl.controller.resource_pool import worker_env, worker_threads

    return preload_modules(cfg), worker_env(worker_threads(cfg))


def wanted(cfg) -> bool:
    """Fork workers for this run: on, a local Ray this run starts (no `ray_address`, Ray not yet up), CPU, and a
    Python with `-P` and `Popen(process_group=)` (3.11)."""
    if (
        sys.version_info < (3, 11)
        or not cfg.resources.fork_workers
        or cfg.resources.ray_address
        or cfg.resources.accelerator != "cpu"
    ):
        return False
    ray = sys.modules.get("ray")  # not imported for this check: the driver's checks come first
    return ray is None or not ray.is_initialized()


class ForkServer:
    """The driver's handle on the server process; `py_executable` is Ray's worker command prefix."""

    def __init__(self, proc: subprocess.Popen, path: str, modules: list[str], env: dict[str, str]):
        self.proc, self.path = proc, path
        self.modules, self.env = modules, env  # what it preloads, under which variables (on top of the driver's)
        self.py_executable = f"{sys.executable} -P {LAUNCHER} {path}"

    @classmethod
    def start(cls, modules: list[str], env: Optional[dict[str, str]] = None) -> "ForkServer":
        """Start the server; it imports `modules` in the background (workers that connect meanwhile wait)."""
        path = os.path.join(tempfile.mkdtemp(prefix="megarl_fork_"), "server.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)  # listening before the server runs: a launcher never misses it, it waits
            listener.listen(64)
            fd = listener.fileno()
            cmd = [sys.executable, "-P", "-m", "megarl.controller.fork_server", str(os.getpid()), str(fd), *modules]
            full_env = {**os.environ, **(env or {})}
            # a process group of its own: a terminal's Ctrl-C is the driver's to handle (it stops the server)
            proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL, pass_fds=[fd], process_group=0)
        return cls(proc, path, list(modules), dict(env or {}))

    def stop(self, grace: float = 5.0) -> None:
        """Stop the server (its children, if any are left, are killed with it); removes its socket."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


# ---------------------------------------------------------------------------- the server process


def _preload(modules: list[str]) -> bool:
    """Import `modules`; False if one of them imported Ray. A Ray imported here keeps this process's settings
    (the cluster's token and job are only in a worker's environment), so its children could not join."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # a worker that needs it imports it itself, and reports the error there
            if os.environ.get("MEGARL_FORK_SERVER_DEBUG") == "1":
                print(f"[megarl] fork server: could not preload {name}: {err}", file=sys.stderr, flush=True)
    return "ray" not in sys.modules


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("launcher closed the connection")
        data += chunk
    return data


def _receive_request(conn: socket.socket) -> tuple[list[int], tuple]:
    header, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    (size,) = struct.unpack("!I", header)
    return fds, pickle.loads(_recv_exact(conn, size))


class _Server:
    def __init__(self, driver: int, listener_fd: int):
        self.listener = socket.socket(fileno=listener_fd)
        self.children: dict[int, socket.socket] = {}
        self.parent = driver

    def serve(self):
        """Fork a child per launcher; returns only in a child, with what it needs to become the worker."""
        while os.getppid() == self.parent:
            self._reap()
            ready, _, _ = select.select([self.listener], [], [], 0.2)
            if not ready:
                continue
            conn, _ = self.listener.accept()
            try:
                fds, request = _receive_request(conn)
            except (OSError, EOFError, struct.error, pickle.UnpicklingError):
                conn.close()
                continue
            sys.stdout.flush(), sys.stderr.flush()  # nothing buffered here is written twice
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                for other in self.children.values():
                    other.close()
                return conn, fds, request
            for fd in fds:
                os.close(fd)
            self.children[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        self.kill_children()  # the driver is gone
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()

    def kill_children(self) -> None:
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def stop(self, _signum, _frame) -> None:
        """SIGTERM (`ForkServer.stop`, or the driver's death): its children go too. `os._exit`: nothing to flush,
        and torch's and vLLM's teardown took 2 s."""
        self.kill_children()
        os._exit(0)


def _become_worker(conn: socket.socket, fds: list[int], request: tuple) -> None:
    """In the forked child: take the launcher's stdio, session, directory, environment and command line,
    then run Ray's worker script as `__main__` (its exit is this process's exit)."""
    argv, env, cwd = request
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    # a group of its own, as Ray gives each worker (`megarl.utils.lifetime.kill_tree`), in a session of its own:
    # with the kernel's autogroup scheduling each worker then gets its own CPU share beside the driver's session
    # (Ray's helpers, the server). In the server's session 3 runs read 14.9-17.5 s to the start-up line, against
    # 13.1-14.4 s in sessions of their own (this VM is noisy)
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    _die_with_launcher(conn)
    import runpy

    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


def _die_with_launcher(conn: socket.socket) -> None:
    """The launcher is the process Ray started and kills: when it is gone, so is this worker and its group."""
    import threading

    from megarl.utils.lifetime import kill_tree

    def watch() -> None:
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        kill_tree()

    threading.Thread(target=watch, name="megarl-die-with-launcher", daemon=True).start()


def _terminate_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    driver, listener_fd, modules = int(argv[0]), int(argv[1]), argv[2:]
    started = time.perf_counter()
    server = _Server(driver, listener_fd)  # a launcher that connects now waits for the preload
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _terminate_with_parent()  # while it preloads; afterwards `serve` also watches
    if os.getppid() != driver:  # gone before that
        return
    if not _preload(modules):  # its launchers run plain workers
        print("[megarl] fork server: a preloaded module imported Ray; workers start as usual", file=sys.stderr)
        return
    if os.environ.get("MEGARL_FORK_SERVER_DEBUG") == "1":
        print(f"[megarl] fork server: preloaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    # the children inherit the preloaded objects frozen: their collections skip them instead of copying every
    # page that holds one (as in `megarl.utils.distributed`'s ranks)
    gc.freeze()
    child = server.serve()
    if child is not None:
        _become_worker(*child)


if __name__ == "__main__":
    main(sys.argv[1:])
