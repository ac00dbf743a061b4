"""Receiving one bucket ahead of the engine: `ReceiveAhead`.

Owns the thread a broadcast receiver (`broadcast.BroadcastReceiver`) takes each bucket on while its engine
checks and loads the one before: the next bucket's bytes cross the group while this one's are copied.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megarl.rollout.sharding.protocol import FlatBucket

__all__ = ["ReceiveAhead"]


class ReceiveAhead:
    """A receiver's buckets received on a thread of its own, one ahead of the engine.

    The thread receives bucket k+1 while the engine's side checks and loads bucket k (`next`), then waits
    until that side asks for bucket k+1 (done with bucket k, whose buffer bucket k+2 may reuse). `finish`
    reads the rest of the update, not handed on, and returns once its end mark was read (the group stays
    in step after a failed check or load).
    """

    def __init__(self, receive, hand_on):
        self._receive, self._hand_on = receive, hand_on  # hand_on(bucket, checksums): checked, or to check
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # the semaphore keeps it to one bucket ahead
        self._asked = threading.Semaphore(0)
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="megarl-bucket-receive", daemon=True)
        self._thread.start()

    def next(self) -> Optional[FlatBucket]:
        """The next bucket as `hand_on` gives it (checked, or with its checksums still to check); None at the
        update's end; a receive's error is raised here."""
        received, error = self._ready.get()
        self._asked.release()  # the engine is done with the bucket before: its buffer may take the next
        if error is not None:
            raise error
        return None if received is None else self._hand_on(*received)

    def finish(self) -> None:
        self._draining = True
        self._asked.release()
        self._thread.join()

    def _run(self) -> None:
        try:
            while (received := self._receive()) is not None:
                if not self._draining:
                    self._ready.put((received, None))
                    self._asked.acquire()
            self._ready.put((None, None))
        except BaseException as err:  # noqa: BLE001 -- the group failed: handed to the engine's side, which raises it
            self._ready.put((None, err))
