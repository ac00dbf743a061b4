"""The `openai` loop: user agent code written against the `openai` client becomes a trainable loop.

`AgentConfig.openai_agent` names the user's function (`pkg.module:fn` or `file.py:fn`); it is called
as `await fn(client, sample)` with an `openai.AsyncOpenAI` client whose requests reach the run's
`ChatServer` under this trajectory's session (a plain `def fn(client, sample)` gets a sync
`openai.OpenAI` client and runs in a thread). Its chat requests generate through this loop's `llm`
(so the trainer's routing and versions apply) and the server records the exact tokens; the last
chain of the session is the trajectory (earlier chains, if the code restarted a conversation, are
counted in `openai_chains`). What the function returns lands in `reward_extras['agent_result']`.
Imports openai lazily.
"""

from __future__ import annotations

import asyncio
import inspect

from megarl.agent.base import OPENAI_AGENTS, AgentContext, AgentLLM, AgentSample, register_agent_loop
from megarl.agent.trajectory import Trajectory


def chat_server(ctx: AgentContext):
    """The run's chat endpoint (started on first use, one per context)."""
    server = getattr(ctx, "_chat_server", None)
    if server is None:
        from megarl.agent.openai_server import ChatServer

        server = ChatServer(ctx.tokenizer, llm_factory=_no_default_route, config=ctx.config, params=ctx.params).start()
        ctx._chat_server = server
    return server


def _no_default_route(session_id: str):
    raise ValueError(
        f"unknown session {session_id!r}: the run's endpoint only serves sessions of running"
        " trajectories (send the X-Session-Id header the openai loop gave the client)"
    )


@register_agent_loop("openai")
async def openai_loop(sample: AgentSample, llm: AgentLLM, ctx: AgentContext) -> Trajectory:
    """Run the user's openai-client agent on this sample and return what the endpoint recorded."""
    if not ctx.config.openai_agent:
        raise ValueError(
            "the openai loop needs AgentConfig.openai_agent = 'pkg.module:fn' (rollout.agent.openai_agent)"
        )
    fn = OPENAI_AGENTS.get(ctx.config.openai_agent)
    server = chat_server(ctx)
    sid = server.open_session(llm, asyncio.get_running_loop())
    try:
        result = await _call_user_agent(fn, server.url, sid, sample)
    finally:
        chains = server.close_session(sid)
    if not chains:
        raise ValueError(f"openai agent {ctx.config.openai_agent!r} made no chat request for this sample")
    trajectory = chains[-1]
    trajectory.reward_extras["agent_result"] = result
    trajectory.metrics["openai_chains"] = float(len(chains))
    return trajectory


async def _call_user_agent(fn, url: str, session_id: str, sample: AgentSample):
    import openai

    headers = {"X-Session-Id": session_id}
    if inspect.iscoroutinefunction(fn):
        async with openai.AsyncOpenAI(base_url=url, api_key="megarl", default_headers=headers, max_retries=0) as client:
            return await fn(client, sample)

    def run():
        with openai.OpenAI(base_url=url, api_key="megarl", default_headers=headers, max_retries=0) as client:
            return fn(client, sample)

    return await asyncio.to_thread(run)
