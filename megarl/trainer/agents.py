"""The generate phase as agent loops: every sample of every prompt becomes one `Trajectory`.

Owns `AgentRollout` (the driver's side of `megarl.agent`): it turns a prompt batch into
`AgentSample`s (one per prompt × sample, seeded as today's single-turn requests are), runs each
row's agent loop concurrently, and routes every turn's request over all rollout engines through
`RoutedLLM` (`cluster.rollout.submit`: least outstanding requests, sticky per session, so each turn
of a conversation goes to the engine holding its prefix cache). When every row's loop is
`single_turn` the requests go as one batch per engine (`cluster.rollout.generate`, today's path) and
each completion becomes the trajectory `single_turn` would have built — the same tokens and
log-probs either way, without a Ray call per request.

Imports the agent package and asyncio; Ray only through the engines' handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Optional

from megarl.agent import AgentContext, AgentSample, Trajectory, run_agent
from megarl.agent.single_turn import completion_trajectory
from megarl.agent.trajectory import summarize
from megarl.data.batch import Batch
from megarl.rollout.base import SamplingParams
from megarl.trainer import batching


class RoutedLLM:
    """`AgentLLM` over the run's engines: one completion per call, every call of a session sticky."""

    def __init__(self, engines, session_id: str):
        self.engines, self.session_id, self.calls = engines, session_id, 0

    async def generate(self, prompt_ids, params: SamplingParams):
        self.calls += 1
        completions = await self.engines.submit(
            list(prompt_ids),
            dataclasses.replace(params, n=1),
            request_id=f"{self.session_id}/{self.calls}",
            session_id=self.session_id,
        )
        return completions[0]


class AgentRollout:
    """Trajectories of a prompt batch: `params.n` per prompt, each from its row's agent loop."""

    def __init__(self, ctx: AgentContext, engines):
        self.ctx, self.engines = ctx, engines
        self.run_coroutine = asyncio.run
        """Runs the agent loops of `run` to completion; the asynchronous trainer hands them to the event loop
        its router is bound to."""

    def run(self, prompts: Batch, params: SamplingParams, seed: Optional[int], session: str) -> list[list[Trajectory]]:
        """Per prompt row, its `params.n` trajectories (in sample order)."""
        if self.all_single_turn(prompts):
            return self._single_turn(prompts, params, seed)
        ctx = dataclasses.replace(self.ctx, params=dataclasses.replace(params, n=1))
        samples = [[self.sample(prompts, row, i, params, seed) for i in range(params.n)] for row in range(len(prompts))]
        return self.run_coroutine(self._agents(samples, ctx, session))

    async def group(
        self, prompts: Batch, row: int, params: SamplingParams, seed: Optional[int], session: str
    ) -> list[Trajectory]:
        """Row `row`'s `params.n` trajectories, each its own request(s) through `RoutedLLM` (the asynchronous
        trainer's unit of work); sample `i` is seeded seed + row + i, as in `run`."""
        ctx = dataclasses.replace(self.ctx, params=dataclasses.replace(params, n=1))
        samples = [self.sample(prompts, row, i, params, seed) for i in range(params.n)]
        return list(
            await asyncio.gather(
                *(run_agent(s, RoutedLLM(self.engines, f"{session}.{i}"), ctx) for i, s in enumerate(samples))
            )
        )

    def all_single_turn(self, prompts: Batch) -> bool:
        """Every row's agent loop is single_turn (its `agent_name`, else the configured default)."""
        default = self.ctx.config.default_agent
        names = prompts["agent_name"] if "agent_name" in prompts else [None] * len(prompts)
        return all((name or default) == "single_turn" for name in names)

    def sample(self, prompts: Batch, row: int, index: int, params: SamplingParams, seed: Optional[int]):
        """Row `row`'s sample `index`; seeded like vLLM's n-sample requests (seed + row + index)."""
        fields = {key: prompts[key][row] for key in prompts.keys()}
        fields["input_ids"] = batching.masked_rows(
            prompts["input_ids"][row : row + 1], prompts["attention_mask"][row : row + 1]
        )[0]
        sample_seed = None if params.greedy or seed is None else seed + row + index
        return AgentSample.from_row(fields, seed=sample_seed)

    def _single_turn(self, prompts: Batch, params: SamplingParams, seed: Optional[int]) -> list[list[Trajectory]]:
        """Today's single-turn requests (one per prompt, its n samples seeded seed + row (+ sample index in
        the engine)), sent as one batch per engine; each completion as the trajectory `single_turn` builds,
        without its turn's text: the batch's `response_text` is decoded once, from the batch (256 decodes
        fewer a quickstart step)."""
        start = time.monotonic()
        requests = batching.requests(prompts, params, seed or 0)
        completions = self.engines.generate(requests)
        seconds = time.monotonic() - start
        return [
            [completion_trajectory(ids, c, seconds=seconds) for c in group]
            for (ids, _), group in zip(requests, completions)
        ]

    async def _agents(self, samples: list[list[AgentSample]], ctx: AgentContext, session: str):
        async def one(row: int, index: int, sample: AgentSample) -> Trajectory:
            return await run_agent(sample, RoutedLLM(self.engines, f"{session}:{row}.{index}"), ctx)

        groups = [asyncio.gather(*(one(r, i, s) for i, s in enumerate(group))) for r, group in enumerate(samples)]
        return [list(group) for group in await asyncio.gather(*groups)]


def agent_metrics(trajectories: list[Trajectory], seconds: float) -> dict:
    """Step metrics of the generate phase: turns, tool calls and errors by kind, tool seconds, masked-token
    share, finish reasons (`megarl.agent.trajectory.summarize`), and trajectories per second."""
    return {**summarize(trajectories), "perf/trajectories_per_s": len(trajectories) / max(seconds, 1e-9)}
