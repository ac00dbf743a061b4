"""vLLM colocated in a training rank: the rollout rank of a PP2 actor hosts the engine.

vLLM's engine core runs in a child process of the training rank (AsyncLLM), and the sharding
manager's buckets reach it as shared-memory IPC buckets (CUDA IPC on GPU), written into the same
shared-memory buffers by every sync. Same checks as the other sync tests (weights moved, outputs
follow the actor, unchanged syncs change nothing), with tied embeddings and a pipeline stage that
holds the tied copy.
"""

import pytest
from rollout_sync_checks import check_sync, colocated_sync_rank, fixed_sequences, hf_greedy, tokens

from megarl.models.layout import ParallelLayout
from megarl.rollout import vllm_available
from megarl.testing.dist import run_distributed

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


def test_vllm_in_a_pp2_training_rank_follows_the_actor(rollout_models):
    results = run_distributed(
        colocated_sync_rank,
        2,
        str(rollout_models["qwen2"]),
        str(rollout_models["qwen2_other"]),
        ParallelLayout(pp=2),
        fixed_sequences(),
        "vllm",
        timeout=300,
    )
    rollout = results[0]
    assert rollout["rollout"] and all(r["exchanges"] == 1 for r in results)
    check_sync(rollout["snaps"], results[-1]["actor"], rollout["weights"], rollout_models["qwen2"], 2e-4)
    assert rollout["version1"] == 1 and rollout["version3"] == 3 and rollout["final_versions"] == {3}
    kept, reused = rollout["kept_reused"]
    assert kept == rollout["buckets"] and reused  # a shared-memory buffer per bucket, written by every sync
    # from the third sync on the engine's CPU worker holds its parameters in those buffers (TP 1: every byte);
    # the fourth sync, after another change, was written by the ranks into the model and it follows the actor
    assert rollout["adopted_bytes"] > 0 and rollout["adopted_bytes_after"] == rollout["adopted_bytes"]
    assert tokens(rollout["snaps"]["adopted"][0]) == hf_greedy(rollout_models["qwen2"], rollout["adopted_weights"])
    assert tokens(rollout["snaps"]["adopted"][0]) != tokens(rollout["snaps"]["resynced"][0])
    assert (rollout["snaps"]["adopted"][1] - results[-1]["actor"]["adopted"]).abs().max() < 2e-4
