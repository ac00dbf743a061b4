"""Two real Ray nodes on one machine: two network namespaces joined by a veth pair, a Ray head in one,
a Ray worker node in the other. Each namespace has its own network stack (own IP, own ports), so the
nodes talk over the veth link as two machines would over a wire, and killing every process of the
worker namespace is losing a node.

Owns `netns_unavailable()` (why not: not Linux, not root, no `ip`, namespaces refused) and
`TwoNodes`, a context manager: `up()` builds the namespaces (`<prefix>h`, `<prefix>w`, addresses
`10.<n>.0.1` and `.2`, both ends named `mrl0` so one GLOO_SOCKET_IFNAME fits both), `start()` (head,
then worker node; or `start_head()` / `start_worker()` + `wait_started(name)`), `kill_worker()` (SIGKILL of every process in the worker namespace), `popen(...)`
(a command in the head namespace, where the driver runs), and `down()` (kills what is left in both
namespaces and deletes them). Needs root and iproute2 (`scripts/setup.sh` installs it on Debian).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

IFNAME = "mrl0"
RAY_PORT = 6379


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> Optional[str]:
    """Why two namespaced Ray nodes cannot be built here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in the CI container)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is missing (scripts/setup.sh installs it on Debian: apt-get install iproute2)"
    probe = f"mrlprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoNodes:
    """A Ray head (namespace `<prefix>h`, 10.<n>.0.1) and a worker node (`<prefix>w`, 10.<n>.0.2)."""

    def __init__(self, workdir: Path, cpus_per_node: int = 1, subnet: Optional[int] = None):
        self.workdir, self.cpus = Path(workdir), cpus_per_node
        n = subnet if subnet is not None else 100 + os.getpid() % 150
        self.prefix = f"mrl{os.getpid() % 100000}"
        self.head_ns, self.worker_ns = f"{self.prefix}h", f"{self.prefix}w"
        self.head_ip, self.worker_ip = f"10.{n}.0.1", f"10.{n}.0.2"
        self.address = f"{self.head_ip}:{RAY_PORT}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": IFNAME,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def up(self) -> "TwoNodes":
        veth_a, veth_b = f"{self.prefix}a", f"{self.prefix}b"
        for ns in (self.head_ns, self.worker_ns):
            _ip("netns", "add", ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for ns, veth, ip in ((self.head_ns, veth_a, self.head_ip), (self.worker_ns, veth_b, self.worker_ip)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "link", "set", veth, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _ray_start(self, name: str, ns: str, *args: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        log = open(self.workdir / f"ray_{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                ray,
                "start",
                "--block",
                f"--num-cpus={self.cpus}",
                "--num-gpus=0",
                "--disable-usage-stats",
                f"--temp-dir=/tmp/ray_{ns}",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def start_head(self) -> None:
        self._ray_start(
            "head",
            self.head_ns,
            "--head",
            f"--node-ip-address={self.head_ip}",
            f"--port={RAY_PORT}",
            "--include-dashboard=false",
        )

    def start_worker(self) -> None:
        self._ray_start("worker", self.worker_ns, f"--address={self.address}", f"--node-ip-address={self.worker_ip}")

    def wait_started(self, name: str, timeout_s: float = 180) -> None:
        """Block until `ray start` of node `name` reports the node running (registered with the head)."""
        log, proc = self.workdir / f"ray_{name}.log", self.procs[name]
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start of the {name} node failed or hung: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def start(self) -> None:
        """Both nodes, running."""
        self.start_head()
        self.wait_started("head")
        self.start_worker()
        self.wait_started("worker")

    def pids(self, ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_worker(self) -> None:
        """Lose the worker node: SIGKILL every process in its namespace (raylet, workers, their children)."""
        for pid in self.pids(self.worker_ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.pop("worker").wait()

    def popen(self, command: list[str], log: Path, env: Optional[dict] = None) -> subprocess.Popen:
        """`command` in the head namespace (the driver's machine), in its own session, logging to `log`."""
        with open(log, "w") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.head_ns, *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )

    def down(self) -> None:
        for ns in (self.worker_ns, self.head_ns):
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            proc.wait()
        self.procs.clear()
        for ns in (self.worker_ns, self.head_ns):
            _ip("netns", "del", ns, check=False)
        for ns in (self.worker_ns, self.head_ns):
            shutil.rmtree(f"/tmp/ray_{ns}", ignore_errors=True)

    def __enter__(self) -> "TwoNodes":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
