"""The driver-side router without Ray: sticky sessions, least outstanding, bounded, reruns after update aborts.

The routing tests drive the router with calls that finish when the test says so (an asyncio event
per request), so which engine got what is exact; the last test routes over two real embedded
engines, one of which is paused in mode abort mid-request (as for a weight update).
"""

import asyncio

import pytest

from megarl.rollout import Completion, SamplingParams
from megarl.rollout.router import EngineRouter


class Calls:
    """Requests in flight through a router: each finishes when `finish(request_id)` is called."""

    def __init__(self, router):
        self.router, self.events, self.engines, self.tasks = router, {}, {}, {}

    def start(self, request_id, session_id=None, results=("length",)):
        self.events[request_id] = asyncio.Event()
        reasons = list(results)

        async def call(engine):
            self.engines.setdefault(request_id, []).append(engine)
            await self.events[request_id].wait()
            self.events[request_id].clear()
            return [Completion([1], None, reasons.pop(0) if len(reasons) > 1 else reasons[0])]

        self.tasks[request_id] = asyncio.ensure_future(self.router.run(request_id, session_id, call))

    def finish(self, request_id):
        self.events[request_id].set()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_new_sessions_go_to_the_least_loaded_engine_and_stay_there():
    async def run():
        router = EngineRouter(3)
        calls = Calls(router)
        calls.start("a1", "A")
        calls.start("a2", "A")  # sticky: engine 0 although 1 and 2 are idle
        calls.start("b1", "B")
        calls.start("c1", "C")
        calls.start("free", None)
        await settle()
        assert [calls.engines[r] for r in ("a1", "a2", "b1", "c1", "free")] == [[0], [0], [1], [2], [1]]
        assert router.outstanding == [2, 2, 1]
        for r in ("a1", "a2", "b1"):
            calls.finish(r)
        await settle()
        assert router.outstanding == [0, 1, 1]
        calls.start("d1", "D")  # the least loaded now: engine 0
        calls.start("b2", "B")  # B stays on engine 1 after its first request ended
        await settle()
        assert calls.engines["d1"] == [0] and calls.engines["b2"] == [1] and router.session_engine("B") == 1
        router.end_session("B")
        assert router.session_engine("B") is None
        for r in ("c1", "free", "d1", "b2"):
            calls.finish(r)
        await asyncio.gather(*calls.tasks.values())
        assert router.outstanding == [0, 0, 0]

    asyncio.run(run())


def test_requests_wait_for_capacity_and_a_session_for_its_own_engine():
    async def run():
        router = EngineRouter(2, max_outstanding=1)
        calls = Calls(router)
        calls.start("a1", "A")
        calls.start("b1", "B")
        calls.start("a2", "A")  # engine 0 is full: waits although nothing frees engine 1 yet
        calls.start("x", None)  # both full: waits
        await settle()
        assert set(calls.engines) == {"a1", "b1"}
        calls.finish("b1")
        await settle()
        assert calls.engines["x"] == [1] and "a2" not in calls.engines  # a2 still waits for engine 0
        calls.finish("a1")
        await settle()
        assert calls.engines["a2"] == [0]
        calls.finish("a2")
        calls.finish("x")
        await asyncio.gather(*calls.tasks.values())

    asyncio.run(run())


def test_a_router_serves_one_event_loop_after_another():
    """A driver may run a loop per step (asyncio.run): waiting for capacity works in each."""
    router = EngineRouter(1, max_outstanding=1)

    async def step():
        calls = Calls(router)
        calls.start("a", "A")
        calls.start("b", "A")  # waits for "a"
        await settle()
        assert "b" not in calls.engines
        calls.finish("a")
        await settle()
        calls.finish("b")
        await asyncio.gather(*calls.tasks.values())
        return calls.engines

    assert asyncio.run(step()) == asyncio.run(step()) == {"a": [0], "b": [0]}


def test_engine_aborts_are_rerun_and_caller_aborts_are_not():
    async def run():
        router = EngineRouter(2, max_reruns=2)
        calls = Calls(router)
        calls.start("updated", results=("abort", "length"))  # an update in pause mode abort ended it once
        calls.start("cancelled", results=("abort",))
        await settle()
        assert router.abort(["cancelled", "not-outstanding"]) == {1: ["cancelled"]}
        calls.finish("cancelled")
        calls.finish("updated")
        await settle()
        calls.finish("updated")
        updated, cancelled = await asyncio.gather(calls.tasks["updated"], calls.tasks["cancelled"])
        assert updated[0].finish_reason == "length" and calls.engines["updated"] == [0, 0]
        assert cancelled[0].finish_reason == "abort" and calls.engines["cancelled"] == [1]
        assert router.reruns == 1
        calls.start("always", results=("abort",))
        for _ in range(3):
            await settle()
            calls.finish("always")
        with pytest.raises(RuntimeError, match="aborted by its engine 3 times"):
            await calls.tasks["always"]
        with pytest.raises(ValueError, match="num_engines"):
            EngineRouter(0)

    asyncio.run(run())


def test_no_request_is_lost_when_an_engine_pauses_in_mode_abort(rollout_models):
    """Two embedded engines behind a router; engine 0 pauses (mode abort) mid-request and resumes:
    the request runs again there and completes; a duplicate id is refused."""
    from rollout_api_checks import greedy

    from megarl.rollout.embedded import EmbeddedEngine

    LONG = 200  # long enough that it is still running when polled and aborted
    engines = [EmbeddedEngine(rollout_models["llama"]), EmbeddedEngine(rollout_models["llama"])]
    expected = engines[1].generate_sync([[1, 5, 9]], greedy(LONG))[0][0].token_ids

    async def run():
        router = EngineRouter(2)
        first = []

        async def call(engine):
            completions = await engines[engine].generate([1, 5, 9], greedy(LONG), request_id="r", session_id="s")
            first.append(completions[0])
            return completions

        task = asyncio.ensure_future(router.run("r", "s", call))
        while engines[0].num_requests == 0:  # in flight (queued or running) on engine 0
            assert not task.done(), "the request finished before it was seen in flight"
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="already outstanding"):
            await router.run("r", None, call)
        await engines[0].pause("abort")
        await engines[0].resume()
        return await task, first

    (done,), attempts = asyncio.run(run())
    assert done.finish_reason == "length" and done.token_ids == expected
    assert len(attempts) == 2 and attempts[0].finish_reason == "abort" and attempts[1] is done
    assert engines[0].generate_sync([[1, 2]], SamplingParams(max_tokens=1, temperature=0))
