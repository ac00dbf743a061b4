"""The embedded (`transformers`) engine's contract, validation and backend selection."""

import pytest
import torch
from rollout_api_checks import check_concurrent_requests, check_sampling_contract
from rollout_sync_checks import GREEDY, PROMPTS, hf_greedy, tokens

import megarl.rollout as rollout
from megarl.rollout import SamplingParams, WeightUpdateError
from megarl.rollout.embedded import EmbeddedEngine


@pytest.fixture(scope="module")
def engine(rollout_models):
    return EmbeddedEngine(rollout_models["llama_other"])


def test_sampling_contract(engine):
    check_sampling_contract(engine)


def test_concurrent_requests_are_batched_and_answered_each(engine):
    check_concurrent_requests(engine)


def test_greedy_equals_transformers_generate(engine, rollout_models):
    assert tokens(engine.generate_sync(PROMPTS, SamplingParams(**GREEDY))) == hf_greedy(rollout_models["llama_other"])


def test_bad_update_names_the_tensor_and_loads_nothing(engine):
    def outputs():
        completions = engine.generate_sync(PROMPTS, SamplingParams(**GREEDY))
        return [[(c.token_ids, c.logprobs) for c in cs] for cs in completions]

    before, version = outputs(), engine.version
    good = ("model.norm.weight", torch.full((128,), 5.0))
    with pytest.raises(WeightUpdateError, match="'model.layers.0.mlp.up_proj.weight' with shape \\(128, 128\\)"):
        engine.update_weights([good, ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 128))], partial=True)
    with pytest.raises(
        WeightUpdateError, match="'model.embed_tokens.weights'.*closest: \\['model.embed_tokens.weight'"
    ):
        engine.update_weights([good, ("model.embed_tokens.weights", torch.zeros(96, 128))], partial=True)
    assert engine.version == version and outputs() == before


def test_create_engine_prefers_vllm_and_falls_back_to_embedded(monkeypatch, rollout_models):
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert isinstance(rollout.create_engine(rollout_models["llama"]), EmbeddedEngine)
    with pytest.raises(ValueError, match="auto, vllm, embedded"):
        rollout.create_engine(rollout_models["llama"], backend="sglang")


def test_temperature_contract(engine, rollout_models):
    from rollout_api_checks import check_temperature_contract

    check_temperature_contract(engine, rollout_models["llama_other"])


def test_requests_from_many_threads_and_event_loops(engine):
    from rollout_api_checks import check_callable_from_threads_and_loops

    check_callable_from_threads_and_loops(engine)


def test_abort_by_id_returns_the_partial_output(engine):
    from rollout_api_checks import check_abort_returns_partial_output

    check_abort_returns_partial_output(engine)


def test_update_midway_switches_versions_at_one_token(engine, rollout_models):
    from rollout_api_checks import check_update_midway_switches_versions

    check_update_midway_switches_versions(engine, rollout_models["llama_other"], rollout_models["llama"])


def test_pause_abort_returns_partial_and_new_requests_wait(engine):
    from rollout_api_checks import check_pause_abort_returns_partial_and_queues_new_requests

    check_pause_abort_returns_partial_and_queues_new_requests(engine)


def test_held_requests_wait_an_aborted_one_ends_at_once_and_the_rest_run_after_release(engine):
    """`hold_requests` (what a vLLM engine's pause does with nothing in flight): new requests wait in megarl;
    `abort` ends a held one at once with no tokens, the others generate once `release_requests` runs."""
    import asyncio

    params = SamplingParams(**GREEDY)

    async def hold(on):
        engine.hold_requests() if on else engine.release_requests()

    async def run():
        await engine.loop.call(hold(True))
        waiting = asyncio.ensure_future(engine.generate(PROMPTS[0], params, request_id="waits"))
        dropped = asyncio.ensure_future(engine.generate(PROMPTS[0], params, request_id="dropped"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and not dropped.done() and engine.num_requests == 2
        await engine.abort("dropped")
        (ended,) = await asyncio.wait_for(dropped, 10)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await engine.loop.call(hold(False))
        return ended, (await asyncio.wait_for(waiting, 60))[0]

    ended, after = asyncio.run(run())
    assert ended.finish_reason == "abort" and ended.token_ids == [] and ended.request_id == "dropped"
    assert after.token_ids == engine.generate_sync([PROMPTS[0]], params)[0][0].token_ids and engine.num_requests == 0


def test_synced_buckets_become_the_parameters_and_a_failed_sync_then_breaks_the_engine(rollout_models, tmp_path):
    """An adopting in-place sender (a sharding manager's syncs) on a dense CPU engine: `check` hands the
    manager the engine's own buffers; `load_buckets` makes a kept bucket's tensors the parameters (every
    later sync writes the model in place: nothing to copy) and copies the others in. No adoption for a
    partial update, another dtype, or MoE experts (views of fused tensors). A sync into the engine's
    buffers that fails before its first bucket arrives may have written some already: the engine then
    refuses requests until an update succeeds instead of keeping its version as if nothing happened. Nor
    where its parameters are not on its device (a GPU engine asleep keeps them on the CPU)."""
    from dataclasses import replace

    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import bucket_tensors
    from megarl.rollout.sharding.senders import sender_for
    from megarl.testing.models import save_tiny_hf_model

    engine = EmbeddedEngine(rollout_models["llama_other"])
    target = EmbeddedEngine(rollout_models["llama"])  # different weights, same config
    weights = [(n, p.detach().clone()) for n, p in target._params.items()]
    specs = [HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights]
    sender = sender_for(engine, adopt=True)
    sender.check(specs, partial=True)
    assert sender.adopt_into is None  # partial: not every bucket would land in the engine's buffers
    sender.check([replace(s, dtype=torch.float16) for s in specs])
    assert sender.adopt_into is None  # a cast: copied in
    sender.check(specs)
    assert sender.adopt_into is engine.update_buffers and not sender.keeps_buffers and not sender.shares_buffers
    kept = [replace(b, kept=True) for b in bucket_tensors(weights[:-1], 1 << 20)]
    loose = list(bucket_tensors(weights[-1:], 1 << 20))
    original = {n: p.data_ptr() for n, p in engine._params.items()}
    assert sender.send(iter(kept + loose), version=1) == 1
    assert sender.adopt_into is None  # held for that sync only: an engine asleep until the next frees its buffers
    views = {n: t for b in kept for n, t in b.tensors()}
    for name, param in engine._params.items():
        assert torch.equal(param, target._params[name]), name
        if name in views:
            assert param.data_ptr() == views[name].data_ptr(), name  # adopted: the bucket is the parameter
        else:
            assert param.data_ptr() == original[name], name  # copied into its own memory
    assert tokens(engine.generate_sync(PROMPTS, SamplingParams(**GREEDY))) == hf_greedy(rollout_models["llama"])
    name, view = next(iter(views.items()))
    view.add_(1.0)  # the next sync writes the buffer: the model holds it, nothing else to do
    assert torch.equal(engine._params[name], view)

    def failing():
        raise RuntimeError("a sender rank died")
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="sender rank died"):
        engine.load_buckets(failing(), version=2)
    assert engine.version == 1 and engine.broken and "mixes two versions" in engine.broken

    engine.device = torch.device("meta")  # parameters elsewhere than the engine keeps them (a GPU engine asleep)
    assert not engine.adopts_update(specs)
    save_tiny_hf_model("qwen2_moe", tmp_path / "moe", seed=0)
    moe = EmbeddedEngine(tmp_path / "moe")
    assert not moe.adopts_update([HFSpec(n, tuple(p.shape), p.dtype) for n, p in moe._params.items()])


def test_an_engines_own_buffers_are_kept_on_its_device_and_no_other():
    """`KeptBuffers(device)` (an engine's `update_buffers`) keeps its device's buffers only, so a sync lands in the
    same memory every time and the engine keeps it as its parameters; another device's (the trainer's GPU, or
    host memory for a GPU engine: buffers it could not adopt) are fresh each time, as are every non-host one of a
    plain `KeptBuffers()`, so no GPU memory stays held beside a trainer's. The meta device stands in for a GPU."""
    from megarl.rollout.sharding.transport import KeptBuffers

    mine, plain = KeptBuffers(torch.device("meta")), KeptBuffers()
    for kept in (mine, plain):
        kept.take("a", 10, torch.bfloat16, "meta")
        kept.take("b", 10, torch.bfloat16, "cpu")
    assert [k for k, _ in mine.buffers] == ["a"] and [k for k, _ in plain.buffers] == ["b"]
    first = mine.buffers[("a", True)]
    mine.take("a", 8, torch.bfloat16, "meta")
    assert mine.buffers[("a", True)] is first  # the same buffer, sync after sync
    elsewhere = KeptBuffers(torch.device("cpu"))
    elsewhere.take("a", 10, torch.bfloat16, "meta")
    assert not elsewhere.buffers
    mine.clear()  # the engine asleep: the buffers go, whoever else holds this object
    assert not mine.buffers
    mine.take("a", 10, torch.bfloat16, "meta")
    assert mine.buffers[("a", True)] is not first  # a new one: the next sync adopts anew


def test_requests_differing_only_in_seed_share_a_batch_and_sample_as_they_would_alone(engine, monkeypatch):
    """The trainer seeds every prompt row apart: those requests run as one batch (a forward pass per token
    for all of them), and each samples the tokens it samples alone."""
    import asyncio

    prompts = [[3, 14, 15, 9], [26, 5, 35, 8], [9, 79, 32, 38]]
    params = [SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=seed) for seed in (7, 8, 9)]
    alone = [[c.token_ids for c in engine.generate_sync([p], s)[0]] for p, s in zip(prompts, params)]
    passes = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, past: passes.append(ids.shape[0]) or forward(ids, past))

    async def together():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    assert [[c.token_ids for c in cs] for cs in engine.run_sync(together())] == alone
    assert passes == [12] * 5  # 3 requests × 4 samples in every pass, one pass per token
    assert len({tuple(map(tuple, a)) for a in alone}) == 3  # the seeds do give different samples
