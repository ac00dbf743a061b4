"""Megatron actor (TP2×PP2, PP2×VPP2) → sharding manager → embedded engine, colocated in rank 0.

The engine starts from a different random model of the same config, so equal outputs prove the
weights moved. Checks: greedy generations equal `transformers` on the actor's weights; the
engine's log-probs of fixed sequences match the actor's megatron forward; a sync after
perturbing the actor changes the outputs, a sync of unchanged weights changes nothing; metadata is
exchanged once; the synced tensors equal the bridge's reference export bit for bit.
"""

import pytest
from rollout_sync_checks import check_sync, colocated_sync_rank, fixed_sequences

from megarl.models.layout import ParallelLayout
from megarl.testing.dist import run_distributed

ATOL = 1e-4


@pytest.mark.parametrize(
    "arch,layout,host_shm",
    [
        ("llama", ParallelLayout(tp=2, pp=2), True),
        ("llama", ParallelLayout(tp=2, pp=2), False),
        ("qwen3", ParallelLayout(pp=2, vpp=2), True),
    ],
    ids=["llama-tp2xpp2", "llama-tp2xpp2-gloo", "qwen3-pp2xvpp2"],
)
def test_embedded_engine_after_sync_matches_actor(rollout_models, arch, layout, host_shm):
    """host_shm: the ranks (one host, CPU) write their shards into the rollout rank's shared memory;
    otherwise (`ShardingManager(host_shm=False)`, the transport of ranks on several hosts) gloo messages."""
    results = run_distributed(
        colocated_sync_rank,
        layout.tp * layout.pp,
        str(rollout_models[arch]),
        str(rollout_models[arch + "_other"]),
        layout,
        fixed_sequences(),
        "embedded",
        host_shm,
        timeout=240,
    )
    assert all(r["host_shm"] == host_shm for r in results)
    assert all("got no sender" in r.get("rejected", "") for r in results)  # the rollout rank's failure, everywhere
    rollout = next(r for r in results if r["rollout"])
    last = results[-1]
    assert all(r["exchanges"] == 1 for r in results)  # metadata once per model, not once per sync
    assert rollout["buckets"] > 3
    check_sync(rollout["snaps"], last["actor"], rollout["weights"], rollout_models[arch], ATOL)
    assert rollout["engine_equals_reference"]  # bit-exact against the bridge's simple export
    assert rollout["params_in_kept"] == 1.0  # adopted: from the second sync on, nothing is copied at the engine
    kept, reused = rollout["kept_reused"]
    assert kept >= rollout["buckets"] and reused  # every sync wrote into the same buffers (the parameters)
    assert rollout["version1"] == 1 and rollout["version3"] == 3 and rollout["final_versions"] == {3}
    # over shared memory every bucket comes with the checksums its writers took as they wrote it, equal to the
    # bucket's own (`writesums`); over gloo none does
    taken, equal = rollout["writer_sums"]
    assert equal and taken == (rollout["buckets"] if host_shm else 0), (taken, rollout["buckets"])


@pytest.mark.parametrize("host_shm", [True, False], ids=["shm", "gloo"])
def test_two_tp_peer_engines_each_get_the_actor_bit_for_bit(rollout_models, host_shm):
    """Both TP ranks are rollout ranks, so each sends its shards to the other and receives the other's
    (the exchange that must be posted as one batch on NCCL; gloo runs it either way; with shared memory
    each rank announces its places before it waits for its peer's)."""
    from rollout_sync_checks import tp_peer_engines_rank

    results = run_distributed(
        tp_peer_engines_rank, 2, str(rollout_models["llama"]), str(rollout_models["llama_other"]), host_shm, timeout=240
    )
    assert [r[:2] for r in results] == [(True, 2), (True, 2)]
    assert all(r[3] == host_shm for r in results)
    assert results[0][2] > 3  # several buckets, so receives run ahead of the bucket being unpacked
