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
from rollout_sync_checks import (actor_log_probs, build_actor, check_sync, engine_snapshot, fixed_sequences,
                                 perturb_layers, reference_export)

ATOL = 1e-4


def embedded_sync_rank(actor_path, engine_path, layout, sequences):
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.sharding.manager import ShardingManager

    bridge, chunks = build_actor(actor_path, layout)
    manager = ShardingManager(bridge, chunks, bucket_bytes=64 << 10)
    engine = EmbeddedEngine(engine_path) if manager.is_rollout_rank else None
    snaps, actor, out = {}, {}, {"rollout": manager.is_rollout_rank}

    def snapshot(tag):
        if engine is not None:
            snaps[tag] = engine_snapshot(engine, sequences)
        actor[tag] = actor_log_probs(chunks, bridge, sequences)

    snapshot("before")
    out["version1"] = manager.sync(engine)
    snapshot("synced")
    perturb_layers(chunks)
    manager.sync(engine)
    snapshot("perturbed")
    reference = reference_export(bridge, chunks)
    out["version3"] = manager.sync(engine)
    snapshot("resynced")
    if engine is not None:
        out["weights"] = reference
        out["engine_equals_reference"] = all(torch.equal(engine._params[n], t) for n, t in reference.items())
        out["final_versions"] = {c.version for cs in snaps["resynced"][0] for c in cs}
    out.update(snaps=snaps, actor=actor, exchanges=manager.metadata_exchanges, buckets=len(manager.plan.buckets))
    return out


@pytest.mark.parametrize("arch,layout", [("llama", ParallelLayout(tp=2, pp=2)), ("qwen3", ParallelLayout(pp=2, vpp=2))],
                         ids=["llama-tp2xpp2", "qwen3-pp2xvpp2"])
def test_embedded_engine_after_sync_matches_actor(rollout_models, arch, layout):
    results = run_distributed(embedded_sync_rank, layout.tp * layout.pp, str(rollout_models[arch]),
                              str(rollout_models[arch + "_other"]), layout, fixed_sequences(), timeout=240)
    rollout = next(r for r in results if r["rollout"])
    last = results[-1]
    assert all(r["exchanges"] == 1 for r in results)  # metadata once per model, not once per sync
    assert rollout["buckets"] > 3
    check_sync(rollout["snaps"], last["actor"], rollout["weights"], rollout_models[arch], ATOL)
    assert rollout["engine_equals_reference"]  # bit-exact against the bridge's simple export
    assert rollout["version1"] == 1 and rollout["version3"] == 3 and rollout["final_versions"] == {3}
