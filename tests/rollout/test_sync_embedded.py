"""Megatron actor (TP2×PP2, PP2×VPP2) → sharding manager → embedded engine, colocated in rank 0.

The engine starts from a different random model of the same config, so equal outputs prove the
weights moved. Checks: greedy generations equal `transformers` on the actor's weights; the
engine's log-probs of fixed sequences match the actor's megatron forward; a sync after
perturbing the actor changes the outputs, a sync of unchanged weights changes nothing; metadata is
exchanged once; the synced tensors equal the bridge's reference export bit for bit.
"""
import pytest
import torch

from megarl.models.layout import ParallelLayout
from megarl.testing.dist import run_distributed

PROMPTS = [[1, 5, 9, 13], [1, 40, 41], [1, 7, 7, 7, 7, 20]]
GREEDY = dict(temperature=0.0, max_tokens=12)
ATOL = 1e-4


def fixed_sequences(vocab=96, n=4, length=20):
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(5))


def actor_log_probs(chunks, bridge, sequences):
    """log π(x_t | x_<t) from megatron's forward (last pipeline stage; None elsewhere)."""
    from megarl.models.parity import megatron_logits

    logits = megatron_logits(chunks, sequences, bridge.dims.vocab_size)
    if logits is None:
        return None
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, sequences[:, 1:, None])[..., 0]


def perturb_layers(chunks, scale=0.05):
    """Deterministic noise on every decoder weight (same on every TP rank for replicated norms)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if ".layers." in name:
                    gen = torch.Generator().manual_seed(hash(name) % (1 << 31))
                    param.add_(scale * torch.randn(param.shape, generator=gen))


def build_actor(actor_path, layout):
    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron, ranks

    init_megatron(layout)
    tp_rank, pp_rank, _ = ranks()
    bridge = ModelBridge.from_hf_path(actor_path, layout)
    chunks = bridge.build(pp_rank)
    bridge.load_hf_weights(chunks, actor_path, tp_rank=tp_rank, pp_rank=pp_rank)
    for chunk in chunks:
        chunk.eval()
    return bridge, chunks


def reference_export(bridge, chunks):
    """The bridge's simple per-parameter export, gathered to rank 0 (independent of the manager)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = dict(bridge.iter_hf_weights(chunks, pp_rank=ps.get_pipeline_model_parallel_rank(),
                                       tp_group=ps.get_tensor_model_parallel_group()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def embedded_sync_rank(actor_path, engine_path, layout, sequences):
    from megarl.rollout import SamplingParams
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.manager import ShardingManager

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=64 << 10)
    engine = EmbeddedEngine(engine_path) if manager.is_rollout_rank else None
    greedy = SamplingParams(**GREEDY)
    out = {"rollout": manager.is_rollout_rank}

    def snapshot(tag):
        if engine is not None:
            out[tag] = engine.generate_sync(PROMPTS, greedy)
            out[tag + "_score"] = torch.tensor(engine.score(sequences.tolist()))
        out[tag + "_actor"] = actor_log_probs(chunks, bridge, sequences)

    snapshot("before")
    out["version1"] = manager.sync(engine)
    snapshot("synced")
    out["buckets"] = len(manager.plan.buckets)
    perturb_layers(chunks)
    manager.sync(engine)
    snapshot("perturbed")
    reference = reference_export(bridge, chunks)
    if engine is not None:
        out["perturbed_weights"] = reference
        out["engine_equals_reference"] = all(torch.equal(engine._params[n], t) for n, t in reference.items())
    out["version3"] = manager.sync(engine)
    snapshot("resynced")
    out["exchanges"] = manager.metadata_exchanges
    return out


def hf_greedy(path_or_weights, config_path, prompts=PROMPTS, max_tokens=GREEDY["max_tokens"]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config_path, dtype=torch.float32).eval()
    if path_or_weights is not None:
        model.load_state_dict(path_or_weights, strict=False)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def check_sync_results(results, actor_path):
    rollout = next(r for r in results if r["rollout"])
    last_stage = next(r for r in reversed(results) if r["synced_actor"] is not None)
    tokens = lambda tag: [c[0].token_ids for c in rollout[tag]]  # noqa: E731
    assert all(r["exchanges"] == 1 for r in results)  # metadata once per model, not per sync
    assert rollout["buckets"] > 3
    # the engine started elsewhere; after the sync it is the actor
    assert tokens("synced") == hf_greedy(None, actor_path)
    assert tokens("before") != tokens("synced")
    assert (rollout["synced_score"] - last_stage["synced_actor"]).abs().max() < ATOL
    assert (rollout["before_score"] - last_stage["synced_actor"]).abs().max() > 0.1
    # a training-like change moves the engine with it, bit-exactly
    assert rollout["engine_equals_reference"]
    assert tokens("perturbed") == hf_greedy(rollout["perturbed_weights"], actor_path)
    assert tokens("perturbed") != tokens("synced")
    assert (rollout["perturbed_score"] - last_stage["perturbed_actor"]).abs().max() < ATOL
    # an unchanged sync changes nothing but the version
    assert tokens("resynced") == tokens("perturbed")
    assert torch.equal(rollout["resynced_score"], rollout["perturbed_score"])
    assert rollout["version1"] == 1 and rollout["version3"] == 3
    assert all(c.version == 3 for cs in rollout["resynced"] for c in cs)
    assert all(len(c.logprobs) == len(c.token_ids) == GREEDY["max_tokens"] for cs in rollout["synced"] for c in cs)


@pytest.mark.parametrize("arch,layout", [("llama", ParallelLayout(tp=2, pp=2)), ("qwen3", ParallelLayout(pp=2, vpp=2))],
                         ids=["llama-tp2xpp2", "qwen3-pp2xvpp2"])
def test_embedded_engine_after_sync_matches_actor(rollout_models, arch, layout):
    results = run_distributed(embedded_sync_rank, layout.tp * layout.pp, str(rollout_models[arch]),
                              str(rollout_models[arch + "_other"]), layout, fixed_sequences(), timeout=240)
    check_sync_results(results, rollout_models[arch])
