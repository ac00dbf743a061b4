"""Engine-contract checks shared by the embedded and vLLM engine tests (any `RolloutEngine`)."""

import asyncio

from megarl.rollout import SamplingParams


def check_sampling_contract(engine):
    """n samples, seeds, stop tokens, finish reasons, log-probs consistent with teacher forcing."""
    prompt = [1, 5, 9, 13]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    first = engine.generate_sync([prompt], sampled)[0]
    again = engine.generate_sync([prompt], sampled)[0]
    assert len(first) == 3 and [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1  # n samples are not copies of one
    for c in first:
        assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == 8
        scored = engine.score([prompt + c.token_ids])[0][len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(scored, c.logprobs)) < 1e-3, (scored, c.logprobs)

    greedy = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8))[0][0]
    stop = greedy.token_ids[3]
    cut = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,)))[0][0]
    first_stop = greedy.token_ids.index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids == greedy.token_ids[: first_stop + 1]


def check_concurrent_requests(engine):
    """Concurrent per-request calls with different params each get their own answers."""

    async def run():
        return await asyncio.gather(
            engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)),
            engine.generate([1, 7, 7, 7, 9], SamplingParams(temperature=0, max_tokens=6, n=2)),
            engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)),
        )

    a, b, c = asyncio.run(run())
    assert len(a) == 1 and len(b) == 2 and [x.token_ids for x in a] == [x.token_ids for x in c]
    assert len(b[0].token_ids) == 6 and b[0].token_ids == b[1].token_ids  # greedy: both samples agree
    assert all(x.version == engine.version for x in a + b + c)


def check_temperature_contract(engine, model_path, temperature=0.7, atol=1e-4):
    """Log-probs at the sampling temperature: a sampled token's is log_softmax(logits / T) of
    `transformers`' teacher-forced logits (fp32), a greedy token's log_softmax(logits) (T = 1)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine.update_weights(sorted(load_file(str(model_path / "model.safetensors")).items()))  # a known model
    prompt = [1, 5, 9, 13]
    sampled = engine.generate_sync([prompt], SamplingParams(temperature=temperature, max_tokens=8, n=2, seed=3))[0]
    greedy = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for completions, temp in ((sampled, temperature), (greedy, 1.0)):
        for c in completions:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            targets = ids[0, len(prompt) :, None]
            expected = torch.log_softmax(logits / temp, -1).gather(-1, targets)[:, 0]
            got = torch.tensor(c.logprobs)
            assert (got - expected).abs().max() < atol, (temp, got, expected)
            if temp != 1.0:  # the check can fail: temperature-1 log-probs are far from these
                assert (got - torch.log_softmax(logits, -1).gather(-1, targets)[:, 0]).abs().max() > 1e-2


# -- continuous batching, abort, pause, per-token versions (both backends) -------------------------
LONG = 200  # tokens of a "long" request (the tiny models allow 256 positions)


def checkpoint(path):
    """The HF tensors of a tiny checkpoint, sorted by name (an update of every tensor)."""
    from safetensors.torch import load_file

    return sorted(load_file(str(path / "model.safetensors")).items())


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


async def midway(request, action, state, delay=0.3, tries=6):
    """Start `request()` and run `action()` after `delay`; `state(result)` says whether the action met
    the request midway ("hit"), before its first token ("early": wait longer next time) or after its
    end ("late": wait less). Retried, since a loaded machine is slow to start. The last result."""
    result = None
    for _ in range(tries):
        task = asyncio.ensure_future(request())
        await asyncio.sleep(delay)
        await action()
        result = await task
        verdict = state(result)
        if verdict == "hit":
            return result
        delay = delay * 2.5 if verdict == "early" else delay / 3
    return result


def check_callable_from_threads_and_loops(engine):
    """Requests from several threads (plain and with their own event loops) at once get their own answers."""
    import concurrent.futures

    prompts = [[1, 5, 9, 13], [1, 40, 41], [1, 7, 7, 7, 7, 20], [1, 2, 3]]
    expected = [cs[0].token_ids for cs in engine.generate_sync(prompts, greedy(10))]

    def plain(prompt):
        return engine.generate_sync([prompt], greedy(10))[0][0].token_ids

    def own_loop(prompt):
        return asyncio.run(engine.generate(prompt, greedy(10), request_id=f"loop-{prompt}"))[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(plain, prompts)) + list(pool.map(own_loop, prompts))
    assert got == expected + expected


def check_abort_returns_partial_output(engine):
    async def run():
        return await midway(
            lambda: engine.generate([1, 5, 9], greedy(LONG), request_id="to-abort"),
            lambda: engine.abort(["to-abort", "unknown-id"]),
            abort_state,
        )

    (c,) = asyncio.run(run())
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < LONG and c.request_id == "to-abort"
    assert len(c.logprobs) == len(c.versions) == len(c.token_ids) and set(c.versions) == {engine.version}
    assert engine.num_requests == 0
    assert len(engine.generate_sync([[1, 5, 9]], greedy(4))[0][0].token_ids) == 4  # still serving


def check_update_midway_switches_versions(engine, old_path, new_path):
    """A weight update while a greedy request runs (the engine pauses itself, mode keep): the request
    finishes; its tokens carry the old version up to one token and the new one after; the tokens
    before the switch are the old weights' greedy ones, those after it a fresh greedy run on the new
    weights from the prompt plus the tokens before the switch."""
    prompt, old, new = [1, 5, 9], checkpoint(old_path), checkpoint(new_path)
    assert engine.update_mode == "keep"
    engine.update_weights(old)
    on_old = engine.generate_sync([prompt], greedy(LONG))[0][0].token_ids
    versions = {}

    async def update():
        versions["old"] = engine.version
        versions["new"] = await asyncio.to_thread(engine.update_weights, new)

    def state(c):
        switched = versions["new"] in c[0].versions
        return "hit" if switched and versions["old"] in c[0].versions else "early" if switched else "late"

    async def run():
        def back_to_old():  # each retry starts on the old weights again
            engine.update_weights(old)
            return engine.generate(prompt, greedy(LONG))

        return await midway(back_to_old, update, state)

    (c,) = asyncio.run(run())
    assert c.finish_reason == "length" and len(c.token_ids) == LONG
    switch = c.versions.index(versions["new"])
    assert 0 < switch < LONG and c.versions == [versions["old"]] * switch + [versions["new"]] * (LONG - switch)
    assert c.version == versions["old"]  # the oldest version among its tokens
    assert c.token_ids[:switch] == on_old[:switch]
    fresh = engine.generate_sync([prompt + c.token_ids[:switch]], greedy(LONG - switch))[0][0]
    assert fresh.token_ids == c.token_ids[switch:] and set(fresh.versions) == {versions["new"]}
    assert fresh.token_ids != on_old[switch:]  # the check can fail: the new weights continue differently


def check_pause_abort_returns_partial_and_queues_new_requests(engine):
    async def run():
        async def pause():
            await engine.pause("abort")
            await engine.pause("keep")  # a no-op while paused

        async def request():
            if engine.paused:
                await engine.resume()
            return await engine.generate([1, 5, 9], greedy(LONG))

        partial = await midway(request, pause, abort_state)
        waiting = asyncio.ensure_future(engine.generate([1, 6, 9], greedy(4)))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # queued while paused, not lost
        await engine.resume()
        return partial, await waiting

    partial, after = asyncio.run(run())
    assert partial[0].finish_reason == "abort" and 0 < len(partial[0].token_ids) < LONG
    assert after[0].finish_reason == "length" and len(after[0].token_ids) == 4 and not engine.paused


def abort_state(completions) -> str:
    c = completions[0]
    return "late" if c.finish_reason != "abort" else "hit" if c.token_ids else "early"
