"""Stopping a command from the outside: Ctrl-C (SIGINT) and SIGTERM.

Owns `GracefulStop`. It re-arms SIGINT even where the process inherited it *ignored* (a `cmd &` in a
non-interactive shell, many launchers: Python then never installs its own handler and Ctrl-C would
do nothing), and handles SIGINT and SIGTERM alike:

* the first signal raises `Interrupted` (a `KeyboardInterrupt`) in the main thread: the run stops
  its workers and says which checkpoint a rerun continues from; the process exits 128 + signal;
* a second signal, or a graceful stop still running after `grace_s`, exits at once (os._exit).

`SigintRearmed` is the plain version for commands without a graceful path (Python's default
handler: KeyboardInterrupt). Both restore the previous handlers on exit (callers in-process, e.g.
tests, keep theirs); `reclaim_signals` puts them back after a library (Ray) replaced them. Imports
only the standard library.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The first SIGINT / SIGTERM: stop gracefully, then exit with `exit_code`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code(err: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the command (a bare KeyboardInterrupt counts as SIGINT)."""
    return err.exit_code if isinstance(err, Interrupted) else 128 + signal.SIGINT


class _Handlers:
    """Installs `self.handlers` ({signum: handler}) on enter (main thread only), restores on exit."""

    handlers: dict = {}

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self.handlers.items():
                self._previous[signum] = signal.signal(signum, handler)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


_ACTIVE: list[_Handlers] = []
"""The handler sets installed now, innermost last."""


def reclaim_signals() -> None:
    """Install the innermost active handlers again, after a library replaced them (main thread only).

    `ray.init` in the main thread sets its own SIGTERM handler (`sys.exit`, and Ray's C++ failure
    handler then aborts: a SIGTERM'd `megarl train` died with exit 134, without the graceful stop
    or the rerun message). Call this after such an init; a no-op without an active `_Handlers`.
    """
    if _ACTIVE and threading.current_thread() is threading.main_thread():
        for signum, handler in _ACTIVE[-1].handlers.items():
            signal.signal(signum, handler)


class SigintRearmed(_Handlers):
    """Ctrl-C raises KeyboardInterrupt, also where SIGINT was inherited ignored."""

    handlers = {signal.SIGINT: signal.default_int_handler}


class GracefulStop(_Handlers):
    """SIGINT/SIGTERM handlers: first signal -> `Interrupted`, second (or `grace_s` later) -> exit now."""

    def __init__(self, grace_s: float = 8.0, name: str = "megarl"):
        self.grace_s, self.name = grace_s, name
        self.first: Optional[int] = None
        self.handlers = {signum: self._handle for signum in HANDLED}
        self._timer: Optional[threading.Timer] = None

    def _handle(self, signum, frame) -> None:
        if self.first is not None:
            self._exit_now(signum, f"second {signal.Signals(signum).name}: exiting at once")
        self.first = signum
        self._timer = threading.Timer(
            self.grace_s, self._exit_now, (signum, f"the graceful stop took over {self.grace_s:g} s: exiting at once")
        )
        self._timer.daemon = True
        self._timer.start()
        raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        """The graceful stop is over (the command returned): no deadline, previous handlers back."""
        if self._timer is not None:
            self._timer.cancel()
        super().__exit__(*exc)

    def _exit_now(self, signum: int, why: str) -> None:
        try:
            os.write(2, f"\n[{self.name}] {why} (workers are stopped by Ray when the driver is gone).\n".encode())
        finally:
            os._exit(128 + signum)
