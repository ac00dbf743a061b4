"""Which processes belong to a run: every process whose environment carries the run's tag.

A test starts `megarl train` with `MEGARL_RUN_TAG=<unique>` in its environment; Ray's processes, the
workers (started by the raylet, which inherits the driver's environment) and everything they start
inherit it, wherever they sit in the process tree. After the run is stopped or killed, `tagged(tag)`
lists what is still alive (zombies excluded: their environment is gone). Linux /proc; standard
library only.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TAG_VAR = "MEGARL_RUN_TAG"


def tagged(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds MEGARL_RUN_TAG=tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(proc.name), cmdline.strip()[:200]))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def wait_until_gone(tag: str, timeout_s: float) -> list[tuple[int, str]]:
    """Poll until no tagged process is left or `timeout_s` passed; what is still alive."""
    deadline = time.monotonic() + timeout_s
    alive = tagged(tag)
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = tagged(tag)
    return alive


def kill_tagged(tag: str) -> int:
    """SIGKILL every tagged process (cleanup after a check); how many were signalled."""
    alive = tagged(tag)
    for pid, _ in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(alive)
