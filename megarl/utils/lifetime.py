"""No process of a run outlives it: worker processes die, with everything they started, when
their parent (Ray's raylet on that node) is gone.

Ray puts each worker in its own process group, outside the driver's: a SIGKILL of the driver's
group (or a lost node) takes the raylet with it, and a worker then exits on its own, but children
it started (multiprocessing managers and resource trackers of checkpointing, vLLM engine cores,
reward pools) can be left behind. `die_with_parent()` starts a daemon thread in the worker that
notices the change of parent and kills the worker's children and process group.

Installed in every worker of a run as Ray's `worker_process_setup_hook` (`RAY_SETUP_HOOK`, set by
`megarl.trainer.run`). `NodeLostError` is what the driver raises when a Ray node of the run died
(`megarl.trainer.run` turns the workers' death into it). Imports psutil only.
"""

from __future__ import annotations

import os
import signal
import threading
import time

RAY_SETUP_HOOK = "megarl.utils.lifetime.die_with_parent"
_started = False


class NodeLostError(RuntimeError):
    """A Ray node holding part of the run died mid-run; the message names it and how to continue."""


def die_with_parent(poll_s: float = 0.5) -> None:
    """Watch this process's parent; when it dies, SIGKILL every descendant and this process (its group)."""
    global _started
    if _started:
        return
    _started = True
    watch_parent(poll_s)


def watch_parent(poll_s: float = 0.5) -> None:
    """`die_with_parent`'s watcher, started unconditionally: for a forked child (whose copy of `_started`
    is its parent's), e.g. a vLLM engine core forked from a worker or a plain script."""
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent, poll_s), name="megarl-die-with-parent", daemon=True).start()


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    kill_tree()


def kill_tree() -> None:
    """SIGKILL this process's descendants, then its process group if it leads one, else itself."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    if os.getpgid(0) == os.getpid():  # a Ray worker leads its own group: its children are in it too
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
