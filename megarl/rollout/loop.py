"""An engine's own event loop: one asyncio loop on a daemon thread, reachable from any thread or loop.

Owns: `EngineLoop`. Every coroutine of a rollout engine runs on its engine's loop (vLLM's
`AsyncLLM` must live on one loop; the embedded engine's scheduler does too), so callers on other
threads (Ray runs actor methods on a thread pool when `max_concurrency > 1`) or other event loops
(an async Ray actor, an agent loop, `asyncio.run` in a test) hand their coroutines over:

    await loop.call(coro)   # from any event loop (directly when it is this loop)
    loop.run(coro)          # from plain code: blocks until done (refused on the loop's own thread)

Cancelling the awaiting caller cancels the coroutine on the engine loop (`run_coroutine_threadsafe`
chains cancellation), so a dropped request is aborted, not left running. Imports the standard library only.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")


class EngineLoop:
    """An asyncio event loop running forever on a daemon thread of its own."""

    def __init__(self, name: str = "megarl-engine"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def on_loop(self) -> bool:
        """True when called from a coroutine (or callback) running on this loop."""
        return _running_loop() is self.loop

    async def call(self, coro: Awaitable[T]) -> T:
        """Await `coro` on this loop from any event loop."""
        if self.on_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        """Run `coro` on this loop from plain code and wait for its result."""
        if self.on_loop() or threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                "a blocking engine call was made on the engine's own event loop, where it would wait"
                " for itself forever: await the engine's coroutine instead"
            )
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the engine was shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its thread (pending coroutines are cancelled first)."""
        if self.loop.is_closed():
            return

        async def cancel_pending():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_pending(), self.loop).result(30)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
