"""Server mode: engine actors under Ray receive the same weights from a megatron actor by broadcast.

Two embedded-engine servers (two vLLM CPU engines would double the start-up and ~1.8 GB each) get
the TP2×PP2 actor's weights over one gloo weight group; one vLLM server receives a full update
once. A rejected update fails on the trainer with the engine's message and every server keeps
serving its previous version.
"""

import sys
import time

import pytest
import torch
from rollout_sync_checks import GREEDY, PROMPTS, build_actor, hf_greedy, tokens

from megarl.models.layout import ParallelLayout
from megarl.rollout import SamplingParams, WeightUpdateError, vllm_available
from megarl.testing.dist import free_port, run_distributed

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's role class travels by value
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from megarl.controller import shutdown_ray

    shutdown_ray()  # no 1 s wait on Ray's autoscaler monitor


def sender_rank(actor_path, layout, port, world_size):
    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup
    from megarl.rollout.sharding.manager import ShardingManager

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=64 << 10)
    sender = (
        BroadcastSender(WeightGroup("127.0.0.1", port, 0, world_size, timeout_s=120))
        if manager.is_rollout_rank
        else None
    )
    version = manager.sync(sender, version=1)
    # by shared memory (every member on this host), into memory the servers' engines took as their parameters
    return version, sender is not None and sender.shares_buffers, sender is not None and sender._adopted.nbytes > 0


def greedy(servers):
    return [tokens(ray.get(s.generate_batch.remote(PROMPTS, SamplingParams(**GREEDY)))) for s in servers]


def test_two_engine_servers_receive_the_same_weights_by_broadcast(ray_cluster, rollout_models):
    from megarl.rollout.server import connect_servers, launch_engine_servers

    servers = launch_engine_servers(str(rollout_models["llama_other"]), 2, backend="embedded", num_cpus=1)
    before = greedy(servers)
    port = free_port()
    joins = connect_servers(servers, "127.0.0.1", port, timeout_s=120)
    updates = [s.receive_update.remote() for s in servers]
    results = run_distributed(
        sender_rank, 4, str(rollout_models["llama"]), ParallelLayout(tp=2, pp=2), port, 3, timeout=240
    )
    ray.get(joins)
    assert ray.get(updates) == [1, 1] and results[0] == (1, True, True)
    after = greedy(servers)  # (the trainer's processes have exited: the servers keep the memory they mapped)
    assert after[0] == after[1] == hf_greedy(rollout_models["llama"]) != before[0]

    # a bad update from the trainer side: every server refuses it before loading, keeps version 1
    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup

    port = free_port()
    joins = connect_servers(servers, "127.0.0.1", port, timeout_s=60)
    sender = BroadcastSender(WeightGroup("127.0.0.1", port, 0, 3, timeout_s=60))
    ray.get(joins)
    updates = [s.receive_update.remote() for s in servers]
    with pytest.raises(WeightUpdateError, match="model.layers.0.self_attn.q_proj.weight"):
        sender.update([("model.layers.0.self_attn.q_proj.weight", torch.zeros(128, 64))], version=2)
    for ref in updates:
        with pytest.raises(Exception, match="q_proj"):
            ray.get(ref)
    assert ray.get([s.version.remote() for s in servers]) == [1, 1]
    assert greedy(servers) == after
    for s in servers:
        ray.kill(s)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_engine_server_receives_a_broadcast_update(ray_cluster, rollout_models):
    from safetensors.torch import load_file

    from megarl.rollout.server import connect_servers, launch_engine_servers
    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup

    (server,) = launch_engine_servers(str(rollout_models["qwen3_other"]), 1, backend="vllm", num_cpus=1)
    port = free_port()
    join = connect_servers([server], "127.0.0.1", port, timeout_s=180)
    sender = BroadcastSender(WeightGroup("127.0.0.1", port, 0, 2, timeout_s=180))
    ray.get(join)
    update = server.receive_update.remote()
    weights = load_file(str(rollout_models["qwen3"] / "model.safetensors"))
    assert sender.update(sorted(weights.items()), version=1) == 1
    assert ray.get(update) == 1 and sender.shares_buffers  # the server mapped the buckets, passed them on by IPC
    assert greedy([server])[0] == hf_greedy(rollout_models["qwen3"])
    ray.kill(server)


class EngineRole:
    """A worker-host role around an embedded engine, called per request like the colocated `Rollout`."""

    def __init__(self, path):
        import threading

        from megarl.rollout.embedded import EmbeddedEngine

        self.engine = EmbeddedEngine(path)
        self.default_thread = threading.get_ident()

    def generate(self, prompt, params, request_id):
        return self.engine.run_sync(self.engine.generate(prompt, params, request_id=request_id))

    def abort(self, request_ids):
        self.engine.run_sync(self.engine.abort(request_ids))

    def thread(self):
        import threading

        return threading.get_ident()

    def num_requests(self):
        return self.engine.num_requests


def test_engine_server_and_worker_host_serve_many_requests_at_once(ray_cluster, rollout_models):
    """An engine server (async actor) and a worker host (its request concurrency group) each take
    several per-request calls at once — a call aborted by id returns its partial output — while the
    host's other calls stay on its one default thread."""
    import asyncio

    from megarl.controller.resource_pool import ResourcePool
    from megarl.controller.worker_group import REQUEST_GROUP, WorkerGroup
    from megarl.rollout.server import launch_engine_servers

    (server,) = launch_engine_servers(str(rollout_models["llama"]), 1, backend="embedded", num_cpus=0.5)
    hosts = WorkerGroup(ResourcePool([1], use_gpu=False, cpus_per_worker=0.5, name="hosts"))
    hosts.add_role("engine", EngineRole, str(rollout_models["llama"]))
    host = hosts.workers[0]
    long, short = SamplingParams(temperature=0, max_tokens=240), SamplingParams(temperature=0, max_tokens=4)

    def request(method, *args):
        return host.call.options(concurrency_group=REQUEST_GROUP).remote(f"engine.{method}", *args)

    async def run():
        served = [
            server.generate.remote([1, 5, 9], long, request_id="long"),
            server.generate.remote([1, 6, 9], short, request_id="short", session_id="s"),
        ]
        hosted = [request("generate", [1, 5, 9], long, "long"), request("generate", [1, 6, 9], short, "short")]

        async def long_in_flight(in_flight, short_ref):
            # Both in flight (queued or running: an abort ends either), or the 4-token request already
            # done and the 240-token one still going — polling may miss the moment both ran together.
            short_done = bool(ray.wait([short_ref], timeout=0)[0])
            return await in_flight >= (1 if short_done else 2)

        async def abort_once_in_flight(num_requests, short_ref, abort):
            # each side on its own: waiting for both at once let one side's long request finish meanwhile
            deadline = time.monotonic() + 120
            while not await long_in_flight(num_requests(), short_ref):
                assert time.monotonic() < deadline, "the long requests never showed as in flight"
                await asyncio.sleep(0.05)
            await abort()

        await asyncio.gather(
            abort_once_in_flight(server.num_requests.remote, served[1], lambda: server.abort.remote(["long"])),
            abort_once_in_flight(
                lambda: host.call.remote("engine.num_requests"), hosted[1], lambda: request("abort", ["long"])
            ),
        )
        return await asyncio.gather(*served), await asyncio.gather(*hosted)

    try:
        served, hosted = asyncio.run(run())
        for long_out, short_out in (served, hosted):
            assert len(short_out[0].token_ids) == 4 and short_out[0].finish_reason == "length"
            assert long_out[0].finish_reason == "abort" and len(long_out[0].token_ids) < 240
        threads = ray.get([host.call.remote("engine.thread") for _ in range(4)])
        assert len(set(threads)) == 1 and threads[0] == ray.get(host.call.remote("engine.thread"))
        ray.get(server.pause.remote("keep"))
        ray.get(server.resume.remote())
        assert len(ray.get(server.generate.remote([1, 2], short))[0].token_ids) == 4
    finally:
        ray.kill(server)
        hosts.shutdown()


def test_an_engine_server_resolves_engine_auto_where_it_runs(rollout_models, monkeypatch):
    """rollout.engine=auto in server mode: the driver (perhaps a CPU head node without vLLM) sends the
    arguments of every backend and each server picks by what imports on its own node."""
    import megarl.rollout as rollout
    from megarl.config import load_config
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.server import EngineServer
    from megarl.workers.rollout import engine_specs

    cfg = load_config("configs/grpo_quickstart.yaml", ["rollout.engine=auto"])
    specs = engine_specs(cfg)
    assert set(specs) == {"vllm", "embedded"} and specs["vllm"]["seed"] == cfg.trainer.seed
    assert set(engine_specs(load_config("configs/grpo_quickstart.yaml", ["rollout.engine=embedded"]))) == {"embedded"}

    monkeypatch.setattr(rollout, "vllm_available", lambda: False)  # this node has no vLLM
    server = EngineServer(str(rollout_models["qwen2"]), "auto", per_backend=specs)
    assert server.backend == "embedded" and isinstance(server.engine, EmbeddedEngine)

    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    with pytest.raises(ValueError, match="no engine arguments for backend 'vllm'"):
        EngineServer(str(rollout_models["qwen2"]), "auto", per_backend={"embedded": specs["embedded"]})

    from megarl.controller.engines import _same_backend

    _same_backend(["vllm", "vllm"], "auto")
    with pytest.raises(RuntimeError, match=r"resolved differently.*server 1: embedded.*install the same vLLM"):
        _same_backend(["vllm", "embedded"], "auto")  # one run, two samplers: refused at start
