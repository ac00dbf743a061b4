"""Benchmark: continuously batched rollout vs one batch at a time, same engine, same requests, same run.

    python benchmarks/continuous_batching.py                       # vLLM (CPU build) when it imports
    python benchmarks/continuous_batching.py --engine embedded     # the transformers engine
    python benchmarks/continuous_batching.py --workload arrivals   # single-turn requests arriving over time

Workloads (lengths drawn once from a fixed seed, long-tailed: most answers short, a few long):
  * multiturn (default) — `--trajectories` agent trajectories of `--turns` turns; each turn asks for
    a response of a long-tailed length, then a simulated tool call sleeps (`--tool-ms`, long-tailed
    too) and appends tool tokens to the conversation; the next turn's prompt is the whole
    conversation (token ids, never re-tokenized).
  * arrivals — `--trajectories` single-turn requests arriving as a Poisson process (`--rate` /s).
Two ways to run the same requests on one engine:
  * continuous — every request is sent the moment it is ready (`await engine.generate(...)`,
    joining the running batch); a trajectory goes on as soon as its own turn is done.
  * batched    — today's behaviour before continuous batching: the ready requests go as one batch
    and the next batch starts when all of it (and, multi-turn, all of its tool calls) is done: a
    barrier per batch, so a short request waits for the longest one of its batch.
Prints trajectories/s of both and the ratio continuous / batched (higher is better; measured in
the same run, alternating, best of --repeats), generated tokens/s, and the latency of a trajectory
(from its arrival to its last token; what arrivals over time mostly change).
"""

import argparse
import asyncio
import os
import random
import tempfile
import time

VOCAB = 512


def lengths(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    """Long-tailed lengths in [low, high]: Pareto(alpha 1.2), so a few requests are much longer."""
    return [min(high, int(low * rng.paretovariate(1.2))) for _ in range(n)]


def make_workload(args) -> list[dict]:
    """Per trajectory: its first prompt, per turn the response length and the tool's (ms, tokens)."""
    rng = random.Random(args.seed)
    turns = 1 if args.workload == "arrivals" else args.turns
    trajectories, clock = [], 0.0
    for _ in range(args.trajectories):
        clock += rng.expovariate(args.rate) if args.workload == "arrivals" else 0.0
        trajectories.append(
            {
                "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 48))],
                "responses": lengths(rng, turns, 8, args.max_response),
                "tools": [
                    (min(5 * args.tool_ms, args.tool_ms * rng.paretovariate(2.0) / 2), rng.randint(4, 16))
                    for _ in range(turns)
                ],
                "arrival": clock,
            }
        )
    return trajectories


def params(max_tokens: int):
    from megarl.rollout import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True)


def tool_tokens(turn: int, count: int) -> list[int]:
    return [3 + (turn * 31 + i * 7) % (VOCAB - 3) for i in range(count)]


async def continuous(engine, workload) -> tuple[int, list[float]]:
    """Every trajectory on its own: each turn is sent as soon as the trajectory is ready for it.
    Returns (generated tokens, per trajectory the seconds from its arrival to its end)."""
    start = time.monotonic()

    async def trajectory(t):
        await asyncio.sleep(max(0.0, t["arrival"] - (time.monotonic() - start)))
        conversation, generated = list(t["prompt"]), 0
        for turn, (length, (tool_ms, tool_count)) in enumerate(zip(t["responses"], t["tools"])):
            (completion,) = await engine.generate(conversation, params(length))
            conversation += completion.token_ids
            generated += len(completion.token_ids)
            if len(t["responses"]) > 1:
                await asyncio.sleep(tool_ms / 1000)  # the tool runs; the engine serves other trajectories
                conversation += tool_tokens(turn, tool_count)
        return generated, time.monotonic() - start - t["arrival"]

    results = await asyncio.gather(*(trajectory(t) for t in workload))
    return sum(g for g, _ in results), [latency for _, latency in results]


async def batched(engine, workload) -> tuple[int, list[float]]:
    """One batch at a time: the ready requests together, the next batch after all of them (and their tools)."""
    start, generated, latency = time.monotonic(), 0, {}
    state = [{"conversation": list(t["prompt"]), "turn": 0} for t in workload]
    pending = list(range(len(workload)))
    while pending:
        now = time.monotonic() - start
        ready = [i for i in pending if workload[i]["arrival"] <= now]
        if not ready:
            await asyncio.sleep(min(workload[i]["arrival"] for i in pending) - now)
            continue
        outs = await asyncio.gather(
            *(
                engine.generate(state[i]["conversation"], params(workload[i]["responses"][state[i]["turn"]]))
                for i in ready
            )
        )
        tools = []
        for i, (completion,) in zip(ready, outs):
            s, t = state[i], workload[i]
            s["conversation"] += completion.token_ids
            generated += len(completion.token_ids)
            tool_ms, tool_count = t["tools"][s["turn"]]
            if len(t["responses"]) > 1:
                tools.append(tool_ms)
                s["conversation"] += tool_tokens(s["turn"], tool_count)
            s["turn"] += 1
        await asyncio.sleep(max(tools, default=0.0) / 1000)  # the batch's tool calls run concurrently
        for i in ready:
            if state[i]["turn"] == len(workload[i]["responses"]):
                latency[i] = time.monotonic() - start - workload[i]["arrival"]
        pending = [i for i in pending if state[i]["turn"] < len(workload[i]["responses"])]
    return generated, [latency[i] for i in range(len(workload))]


def make_engine(kind: str, path: str, max_len: int):
    from megarl.rollout import create_engine

    if kind == "vllm":
        return create_engine(path, backend="vllm", max_model_len=max_len, cpu_kv_cache_bytes=512 << 20)
    return create_engine(path, backend="embedded")


def write_model(path: str, max_len: int) -> None:
    from megarl.testing.models import save_tiny_hf_model

    save_tiny_hf_model(
        "qwen2",
        path,
        vocab_size=VOCAB,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=max_len,
        initializer_range=0.2,
    )


def run(args) -> dict:
    workload = make_workload(args)
    turns = len(workload[0]["responses"])
    max_len = 64 + turns * (args.max_response + 16)  # prompt ≤ 48, then per turn a response and ≤ 16 tool tokens
    with tempfile.TemporaryDirectory(prefix="megarl-cb-") as path:
        write_model(path, max_len)
        engine = make_engine(args.engine, path, max_len)
        try:
            engine.generate_sync([[1, 2, 3]], params(4))  # warm-up
            times = {"continuous": [], "batched": []}
            tokens, latencies = {}, {}
            for _ in range(args.repeats):  # alternate, so machine load hits both alike
                for name, fn in (("continuous", continuous), ("batched", batched)):
                    t0 = time.perf_counter()
                    tokens[name], latency = asyncio.run(fn(engine, workload))
                    times[name].append(time.perf_counter() - t0)
                    latencies[name] = min(latencies.get(name, latency), latency, key=sum)
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()
    return {
        "times": {k: min(v) for k, v in times.items()},
        "tokens": tokens,
        "latencies": latencies,
        "workload": workload,
    }


def report(result, args) -> None:
    t, workload = result["times"], result["workload"]
    responses = [r for w in workload for r in w["responses"]]
    print(
        f"engine: {args.engine}; workload: {args.workload}, {len(workload)} trajectories x"
        f" {len(workload[0]['responses'])} turns; response lengths min {min(responses)} median"
        f" {sorted(responses)[len(responses) // 2]} max {max(responses)}; load average {os.getloadavg()[0]:.1f}"
    )
    lat = {name: sorted(v) for name, v in result["latencies"].items()}
    for name in ("continuous", "batched"):
        print(
            f"  {name:10s} {t[name]:7.2f} s   {len(workload) / t[name]:7.2f} trajectories/s"
            f"   {result['tokens'][name] / t[name]:8.0f} generated tokens/s   latency mean"
            f" {sum(lat[name]) / len(lat[name]):6.2f} s  p90 {lat[name][int(0.9 * (len(lat[name]) - 1))]:6.2f} s"
        )
    print(
        f"ratio continuous / batched (trajectories/s): {t['batched'] / t['continuous']:.2f}   (mean latency):"
        f" {sum(lat['batched']) / sum(lat['continuous']):.2f}x lower"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("vllm", "embedded"), default=None, help="default: vllm if it imports")
    parser.add_argument("--workload", choices=("multiturn", "arrivals"), default="multiturn")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-response", type=int, default=256, help="longest response of one turn (tokens)")
    parser.add_argument("--tool-ms", type=float, default=100.0, help="typical simulated tool time per turn")
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals: requests per second")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.engine is None:
        from megarl.rollout import vllm_available

        args.engine = "vllm" if vllm_available() else "embedded"
    report(run(args), args)


if __name__ == "__main__":
    main()
