"""Shared pieces of the weight-sync tests: the megatron actor side (run in gloo ranks) and the checks.

Importable by name in spawned ranks (pytest puts this folder on sys.path, and ranks inherit it).
"""

import concurrent.futures

import torch

PROMPTS = [[1, 5, 9, 13], [1, 40, 41], [1, 7, 7, 7, 7, 20]]
GREEDY = dict(temperature=0.0, max_tokens=12)


def fixed_sequences(vocab=96, n=4, length=20):
    """Token sequences scored by engine and actor (n a multiple of PP for interleaved schedules)."""
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(5))


def build_actor(actor_path, layout):
    """Megatron chunks of this rank, loaded from an HF checkpoint (init_megatron + the bridge)."""
    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import expert_ranks, init_megatron, ranks

    init_megatron(layout)
    tp_rank, pp_rank, _ = ranks()
    bridge = ModelBridge.from_hf_path(actor_path, layout)
    chunks = bridge.build(pp_rank)
    bridge.load_hf_weights(chunks, actor_path, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=expert_ranks()[0])
    for chunk in chunks:
        chunk.eval()
    return bridge, chunks


def actor_log_probs(chunks, bridge, sequences):
    """log π(x_t | x_<t), t ≥ 1, from megatron's forward (last pipeline stage; None elsewhere)."""
    from megarl.models.parity import megatron_logits

    logits = megatron_logits(chunks, sequences, bridge.dims.vocab_size)
    if logits is None:
        return None
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, sequences[:, 1:, None])[..., 0]


def perturb_layers(chunks, scale=0.05):
    """Deterministic noise on every decoder weight, as a training step would change them.

    Seeded by name, so replicated norms stay equal across TP ranks; embeddings are left alone
    (with tied embeddings and PP > 1, megatron keeps the two copies equal by all-reducing grads).
    """
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if ".layers." in name:
                    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 % (1 << 31))
                    param.add_(scale * torch.randn(param.shape, generator=gen))


def reference_export(bridge, chunks):
    """The bridge's per-parameter export (independent of the manager), gathered on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.runtime import expert_ranks

    mine = dict(
        bridge.iter_hf_weights(
            chunks,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            ep_group=expert_ranks()[1],
        )
    )
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def engine_snapshot(engine, sequences):
    """(greedy completions of PROMPTS, engine log-probs of `sequences`) of an engine."""
    from megarl.rollout import SamplingParams

    return engine.generate_sync(PROMPTS, SamplingParams(**GREEDY)), torch.tensor(engine.score(sequences.tolist()))


def hf_greedy(config_path, weights=None, prompts=PROMPTS, max_tokens=GREEDY["max_tokens"]):
    """`transformers.generate` greedy continuations, one prompt at a time, with optional weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config_path, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all(n == "lm_head.weight" for n in missing), (missing, unexpected)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            gen = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def tokens(completions):
    return [c[0].token_ids for c in completions]


def check_sync(snaps, actor, weights, actor_path, atol):
    """snaps: tag → (completions, scores) on the engine; actor: tag → actor log-probs (last stage)."""
    # the engine started from other weights; after the sync it is the actor
    assert tokens(snaps["synced"][0]) == hf_greedy(actor_path)
    assert tokens(snaps["before"][0]) != tokens(snaps["synced"][0])
    assert (snaps["synced"][1] - actor["synced"]).abs().max() < atol
    assert (snaps["before"][1] - actor["synced"]).abs().max() > 0.1
    # a training-like change moves the engine with it
    assert tokens(snaps["perturbed"][0]) == hf_greedy(actor_path, weights)
    assert tokens(snaps["perturbed"][0]) != tokens(snaps["synced"][0])
    assert (snaps["perturbed"][1] - actor["perturbed"]).abs().max() < atol
    # a sync of unchanged weights changes nothing (but the version)
    assert tokens(snaps["resynced"][0]) == tokens(snaps["perturbed"][0])
    assert torch.equal(snaps["resynced"][1], snaps["perturbed"][1])
    for completions in snaps["synced"][0]:
        assert all(len(c.logprobs) == len(c.token_ids) == GREEDY["max_tokens"] for c in completions)


def colocated_sync_rank(actor_path, engine_path, layout, sequences, backend="embedded", host_shm=True):
    """Every rank of the actor; the rollout rank hosts the engine (colocated). Sync, perturb, sync, sync.
    host_shm: senders write into the rollout rank's shared memory (False: gloo messages)."""
    from megarl.rollout.sharding import writesums
    from megarl.rollout.sharding.manager import ShardingManager
    from megarl.rollout.sharding.protocol import WeightUpdateError, checksums
    from megarl.rollout.sharding.senders import sender_for

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=64 << 10, host_shm=host_shm)
    writesums.MIN_BUCKET_BYTES = 0  # this tiny model's buckets are summed by their writers too
    engine = _make_engine(backend, engine_path) if manager.is_rollout_rank else None
    sender = sender_for(engine, adopt=True) if engine is not None else None
    snaps, actor, out = {}, {}, {"rollout": manager.is_rollout_rank, "host_shm": manager.peers is not None}
    # every sync writes into the same buffers: the engine's (the embedded engine's parameters; a vLLM engine's
    # IPC sender's shared memory, which its CPU workers take as their parameters)
    kept = getattr(engine, "update_buffers", None) or getattr(sender, "buffers", None) or manager.kept

    def snapshot(tag):
        if engine is not None:
            snaps[tag] = engine_snapshot(engine, sequences)
        actor[tag] = actor_log_probs(chunks, bridge, sequences)

    try:
        try:  # a rollout rank whose check fails (here: no sender) fails the sync on every rank, nothing moved
            manager.sync(None, version=1)
        except WeightUpdateError as err:
            out["rejected"] = str(err)
        snapshot("before")
        out["version1"] = manager.sync(sender, version=1)
        kept_after_first = {k: b.data_ptr() for k, b in kept.buffers.items()}
        snapshot("synced")
        perturb_layers(chunks)
        manager.sync(sender, version=2)
        snapshot("perturbed")
        reference = reference_export(bridge, chunks)
        out["version3"] = manager.sync(sender, version=3)
        out["kept_reused"] = (
            len(kept_after_first),
            kept_after_first == {k: b.data_ptr() for k, b in kept.buffers.items()},
        )
        snapshot("resynced")
        if backend == "vllm":  # the third sync replayed the workers' loaders: their parameters took the buffers
            out["adopted_bytes"] = _adopted_bytes(engine)
            perturb_layers(chunks, scale=0.2)  # written by the ranks straight into the engine's parameters
            out["version4"] = manager.sync(sender, version=4)
            snapshot("adopted")
            out["adopted_weights"] = reference_export(bridge, chunks)
            out["adopted_bytes_after"] = _adopted_bytes(engine)
        # the checksums the writers took as they wrote each bucket (shared memory), against the bucket's own
        found = [
            (f.sums is not None, f.sums is None or torch.equal(f.sums, checksums(f))) for f in manager.iter_buckets()
        ]
        out["writer_sums"] = (sum(taken for taken, _ in found), all(equal for _, equal in found))
        if engine is not None:
            out["weights"] = reference
            if backend == "embedded":
                out["engine_equals_reference"] = all(torch.equal(engine._params[n], t) for n, t in reference.items())
                # the engine's parameters are the manager's kept buffers: later syncs wrote into the model
                out["params_in_kept"] = sum(within(t, kept.buffers.values()) for t in engine._params.values()) / len(
                    engine._params
                )
            out["final_versions"] = {c.version for cs in snaps["resynced"][0] for c in cs}
    finally:
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
    out.update(snaps=snaps, actor=actor, exchanges=manager.metadata_exchanges, buckets=len(manager.plan.buckets))
    return out


def _adopted_bytes(engine) -> int:
    return sum(engine.run_sync(engine.llm.collective_rpc("megarl_adopted_bytes"))) if engine is not None else 0


def within(tensor, buffers) -> bool:
    """Whether `tensor`'s memory lies wholly inside one of `buffers` (a view, not a copy)."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return any(b.data_ptr() <= start and end <= b.data_ptr() + b.numel() * b.element_size() for b in buffers)


def ep_sync_rank(actor_path, engine_path, layout, sequences):
    """An expert-parallel actor synced into an embedded engine on rank 0: the engine's tensors after a
    sync and after a perturbed re-sync, the bridge's EP-gathered export, and log-probs of both sides."""
    from megarl.rollout.sharding.manager import ShardingManager
    from megarl.rollout.sharding.senders import sender_for

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=32 << 10)
    engine = _make_engine("embedded", engine_path) if manager.is_rollout_rank else None
    sender = sender_for(engine) if engine is not None else None
    out = {
        "rollout": manager.is_rollout_rank,
        "buckets": len(manager.plan.buckets),
        "sources": sorted({b.source for b in manager.plan.buckets}),
    }
    if engine is not None:
        out["before"] = torch.tensor(engine.score(sequences.tolist()))
    manager.sync(sender, version=1)
    out["actor"] = actor_log_probs(chunks, bridge, sequences)
    if engine is not None:
        out["synced"] = {n: t.clone() for n, t in engine._params.items()}
        out["scores"] = torch.tensor(engine.score(sequences.tolist()))
    perturb_layers(chunks)
    manager.sync(sender, version=2)
    reference = reference_export(bridge, chunks)
    if engine is not None:
        out["perturbed_equals_reference"] = set(reference) == set(engine._params) and all(
            torch.equal(engine._params[n], t) for n, t in reference.items()
        )
    return out


def _make_engine(backend, path):
    from megarl.rollout import create_engine

    return create_engine(path, backend=backend)


def actor_sender_rank(actor_path, layout, sequences, port, steps, first_version=1):
    """Every rank of the actor: sync after each step of `steps` ("sync", "perturb", "score_sampled"),
    as policy versions first_version, first_version + 1, ..."""
    import torch.distributed as dist

    from megarl.rollout.sharding.broadcast import BroadcastSender, WeightGroup
    from megarl.rollout.sharding.manager import ShardingManager

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=64 << 10)
    group = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=120) if manager.is_rollout_rank else None
    sender = BroadcastSender(group) if group else None
    out = {"actor": {}, "versions": []}
    for step in steps:
        if step == "perturb":
            perturb_layers(chunks)
            out["weights"] = reference_export(bridge, chunks)
        elif step == "score_sampled":  # sequences sampled by the engine, sent back over the weight group
            box = [group.broadcast_object(src=1) if group else None]
            dist.broadcast_object_list(box, src=manager.rollout_ranks[0])
            out["sampled_actor"] = actor_log_probs(chunks, bridge, box[0])
        else:
            out["versions"].append(manager.sync(sender, version=first_version + len(out["versions"])))
            out["actor"][step] = actor_log_probs(chunks, bridge, sequences)
    if sender:
        sender.close()
    out["exchanges"] = manager.metadata_exchanges
    return out


def run_actor_and_receive(engine, actor_path, layout, steps, on_update):
    """Run the actor ranks in a thread while this thread receives each update into `engine`
    (policy versions continue from the engine's)."""
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, WeightGroup
    from megarl.testing.dist import free_port, run_distributed

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_distributed,
            actor_sender_rank,
            layout.min_world_size,
            str(actor_path),
            layout,
            fixed_sequences(),
            port,
            steps,
            engine.version + 1,
            timeout=240,
        )
        group = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=120)
        receiver = BroadcastReceiver(group, engine)
        for step in steps:
            if step == "score_sampled":
                group.broadcast_object(on_update(step), src=1)
            elif step != "perturb":
                receiver.receive_update()
                on_update(step)
        assert receiver.receive_update() is None  # the sender closed the group
        return future.result()


def tp_peer_engines_rank(actor_path, engine_path, host_shm=True):
    """A TP2 actor whose two TP ranks each host an engine (two TP1 engines, as `workers.rollout` places
    them for `rollout.tp=1`): every sharded bucket goes both ways between the two ranks. After a sync and
    a perturbed re-sync: does this rank's engine hold the bridge's reference export bit for bit?
    Also returns whether the ranks wrote into each other's shared memory (`host_shm`)."""
    from megarl.models.layout import ParallelLayout
    from megarl.rollout.sharding.manager import ShardingManager
    from megarl.rollout.sharding.senders import sender_for

    bridge, chunks = build_actor(actor_path, ParallelLayout(tp=2))
    manager = ShardingManager(bridge, chunks, bucket_bytes=32 << 10, rollout_ranks=[0, 1], host_shm=host_shm)
    engine = _make_engine("embedded", engine_path)
    manager.sync(sender_for(engine), version=1)
    perturb_layers(chunks)
    manager.sync(sender_for(engine), version=2)
    reference = reference_export(bridge, chunks)
    exact = set(reference) == set(engine._params) and all(
        torch.equal(engine._params[n], t) for n, t in reference.items()
    )
    return exact, engine.version, len(manager.plan.buckets), manager.peers is not None
