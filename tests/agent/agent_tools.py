"""Tools that misbehave (raise, hang, flood) and one that records its lifecycle, for the agent tests."""

import asyncio
import time

from megarl.agent.tools import Tool, ToolResult

_EMPTY = {"type": "object", "properties": {}}


def _schema(name, params=None):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params or _EMPTY}}


class Raiser(Tool):
    default_schema = _schema("explode")

    def execute(self, state, arguments):
        raise RuntimeError("boom")


class Hanger(Tool):
    default_schema = _schema("hang")

    async def execute(self, state, arguments):
        await asyncio.sleep(3600)


class SyncHanger(Tool):
    default_schema = _schema("sync_hang")

    def execute(self, state, arguments):
        time.sleep(3)
        return "late"


class Sleeper(Tool):
    default_schema = _schema("nap", {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]})

    async def execute(self, state, arguments):
        await asyncio.sleep(arguments["s"])
        return f"slept {arguments['s']}"


class Flood(Tool):
    default_schema = _schema("flood")

    def __init__(self, schema=None, *, chars=5_000_000):
        super().__init__(schema)
        self.chars = chars

    def execute(self, state, arguments):
        return "0123456789" * (self.chars // 10)


class Counter(Tool):
    """Counts calls per trajectory; the count is its reward; every lifecycle step is logged."""

    default_schema = _schema("count")
    log: list = []

    async def create(self, sample):
        Counter.log.append(("create", sample.index))
        return {"n": 0, "sample": sample.index}

    def execute(self, state, arguments):
        state["n"] += 1
        Counter.log.append(("execute", state["sample"], state["n"]))
        return ToolResult(str(state["n"]), reward=0.25, metrics={"count": 1})

    async def reward(self, state):
        Counter.log.append(("reward", state["sample"]))
        return float(state["n"])

    async def release(self, state):
        Counter.log.append(("release", state["sample"]))


class BadRelease(Tool):
    default_schema = _schema("leaky")

    def execute(self, state, arguments):
        return "ok"

    def release(self, state):
        raise OSError("cannot release")
