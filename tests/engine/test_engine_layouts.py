"""One actor update gives the same loss and gradients at every layout and micro-batch split.

Gradients are read through Adam with ε ≫ |g| and lr = ε, whose first step moves each weight by
≈ −g (exactly the same function of g at every layout), so equal parameter deltas mean equal
gradients. Scenarios of one world size share one set of processes (each builds its own groups).
"""

import engine_cases as C
import pytest
import torch

from megarl.models.layout import ParallelLayout as L
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_layouts")
    save_tiny_hf_model("llama", root / "llama", seed=0)
    save_tiny_hf_model("qwen2", root / "qwen2_4l", seed=1, num_layers=4)
    return {"llama": str(root / "llama"), "qwen2_4l": str(root / "qwen2_4l")}


def _merge(per_rank, index):
    """Loss, grad norm and micro-batches of scenario `index` (rank 0) and the deltas of every stage."""
    loss, norm, micro, _ = per_rank[0][index]
    deltas = {}
    for rank_results in per_rank:
        deltas.update(rank_results[index][3])
    return loss, norm, micro, deltas


def _assert_same(result, reference):
    loss, norm, _, deltas = result
    ref_loss, ref_norm, _, ref_deltas = reference
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert deltas.keys() == ref_deltas.keys()
    for name in ref_deltas:
        torch.testing.assert_close(
            deltas[name], ref_deltas[name], rtol=1e-3, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_actor_and_critic_updates_match_single_process_at_tp2_pp2_dp2_tp2xpp2_vpp_recompute_and_splits(models):
    llama, qwen = models["llama"], models["qwen2_4l"]
    full, critic = {"loss": C.full_actor_loss()}, {"critic": True}
    single = run_distributed(
        C.updates_rank,
        1,
        [
            (llama, L(), 1000),
            (llama, L(), 14),
            (qwen, L(), 1000),
            (llama, L(), 1000, {"recompute": True}),
            (llama, L(), 1000, full),
            (llama, L(), 1000, critic),
        ],
        timeout=300,
    )
    two = run_distributed(
        C.updates_rank,
        2,
        [
            (llama, L(tp=2), 1000),
            (llama, L(pp=2), 14),
            (llama, L(), 1000),
            (qwen, L(pp=2, vpp=2), 30),
            (llama, L(), 14, full),
            (llama, L(tp=2), 1000, critic),
            (llama, L(pp=2), 20, critic),
        ],
        timeout=300,
    )
    four = run_distributed(C.updates_rank, 4, [(llama, L(tp=2, pp=2), 20)], timeout=300)
    reference = _merge(single, 0)
    assert reference[2] == 1 and _merge(single, 1)[2] >= 4
    assert max(reference[3]["model.layers.0.self_attn.q_proj.weight"].abs().max(), 0) > 1e-4  # a real update
    _assert_same(_merge(single, 1), reference)
    _assert_same(_merge(single, 3), reference)  # full activation recompute
    for index in range(3):
        _assert_same(_merge(two, index), reference)
    _assert_same(_merge(two, 3), _merge(single, 2))
    _assert_same(_merge(two, 4), _merge(single, 4))  # PPO + KL + entropy, seq-mean-token-mean, DP2 x micro-batches
    _assert_same(_merge(two, 5), _merge(single, 5))  # critic (value head, clipped value loss) at TP2
    _assert_same(_merge(two, 6), _merge(single, 5))  # ... and at PP2 with micro-batches
    _assert_same(_merge(four, 0), reference)


def test_an_update_without_old_log_probs_takes_them_from_its_own_forward(models):
    """The step's only update may skip the separate log-prob forward: the same loss, gradients and policy
    statistics as when fed that forward's log-probs, and the rollout/train gap measured on its own forward
    (token-weighted mean over micro-batches and DP ranks, max for the max)."""
    from megarl.algorithms import mismatch_metrics

    per_rank = run_distributed(C.on_policy_rank, 2, models["llama"], timeout=300)
    for result in per_rank:
        (fed, fed_deltas), (own, own_deltas) = result["recomputed"], result["own"]
        assert own["loss"] == pytest.approx(fed["loss"], rel=1e-5, abs=1e-6)
        assert own["grad_norm"] == pytest.approx(fed["grad_norm"], rel=1e-4)
        for key in ("pg_loss", "pg_clipfrac", "entropy"):
            assert own[key] == pytest.approx(fed[key], rel=1e-4, abs=1e-6), key
        for name in fed_deltas:
            torch.testing.assert_close(own_deltas[name], fed_deltas[name], rtol=1e-3, atol=2e-6)
        assert not any(k.startswith("rollout_mismatch") for k in fed)
    old, rollout, mask = (torch.cat([r["gap_inputs"][i] for r in per_rank]) for i in range(3))
    expected = mismatch_metrics(old, rollout, mask)
    for key, value in expected.items():
        assert per_rank[0]["own"][0][f"rollout_{key}"] == pytest.approx(float(value), rel=1e-4, abs=1e-7), key
