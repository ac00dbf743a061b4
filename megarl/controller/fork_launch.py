"""Ray's worker command under `megarl.controller.fork_server`: `python -P fork_launch.py SOCKET default_worker.py ...`.

Standard library only, run as a script (`-P`: its directory is not put on sys.path). Hands the server this
process's command line, environment, working directory and stdin/stdout/stderr, then stands in for the
forked worker: forwards SIGTERM/SIGINT/SIGHUP to it, kills it when this process's parent (the raylet) is
gone, and exits with its exit status. Without a server to reach, it execs the plain Python worker.
"""

import os
import pickle
import select
import signal
import socket
import struct
import sys


def _plain_worker(argv: list) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # the child is gone; its status is on its way
        pass


def _exit_as(code: int) -> None:
    """Exit as the child did: with its code, or killed by the same signal (a negative code)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    parent = os.getppid()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        payload = pickle.dumps((argv, dict(os.environ), os.getcwd()))
        socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], [0, 1, 2])
        line = _read_line(conn)  # the child's pid, once the server has preloaded and forked
    except OSError:
        line = b""
    if not line:
        _plain_worker(argv)
    pid = int(line)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    while True:
        ready, _, _ = select.select([conn], [], [], 0.5)
        if ready:
            status = _read_line(conn).strip()
            _exit_as(int(status) if status else 1)  # no status: the server and the child are gone
        if os.getppid() != parent:  # the raylet is gone: so is its worker
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os._exit(1)


if __name__ == "__main__":
    main()
