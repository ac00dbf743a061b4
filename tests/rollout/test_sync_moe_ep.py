"""An expert-parallel MoE actor (Mixtral, EP2 and TP2×EP2) → sharding manager → embedded engine.

Each EP rank sends its own experts; the engine must end up with every expert under its global HF
name. Checks: after a sync the engine's tensors equal the HF checkpoint bit for bit and its
log-probs equal the actor's megatron forward (the engine started from other weights); after a
training-like perturbation and a re-sync they equal the bridge's EP-gathered export.
"""

import pytest
import torch
from rollout_sync_checks import ep_sync_rank, fixed_sequences
from safetensors.torch import load_file

from megarl.models.layout import ParallelLayout
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def mixtral_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_sync")
    for name, seed in (("actor", 30), ("other", 31)):
        save_tiny_hf_model("mixtral", root / name, seed=seed)
    return root / "actor", root / "other"


@pytest.mark.parametrize("layout", [ParallelLayout(ep=2), ParallelLayout(tp=2, ep=2)], ids=["ep2", "tp2xep2"])
def test_ep_actor_sync_gives_the_engine_every_expert(mixtral_pair, layout):
    actor, other = mixtral_pair
    results = run_distributed(
        ep_sync_rank, layout.min_world_size, str(actor), str(other), layout, fixed_sequences(), timeout=240
    )
    rollout = next(r for r in results if r["rollout"])
    assert rollout["sources"] == [(0, 0), (0, 1)]  # both EP ranks ship buckets
    checkpoint = load_file(actor / "model.safetensors")
    assert set(rollout["synced"]) == set(checkpoint)
    different = [n for n, t in checkpoint.items() if not torch.equal(rollout["synced"][n], t)]
    assert not different, different
    actor_logps = next(r["actor"] for r in results if r["actor"] is not None)
    assert (rollout["scores"] - actor_logps).abs().max() < ATOL
    assert (rollout["before"] - actor_logps).abs().max() > 0.1
    assert rollout["perturbed_equals_reference"]
