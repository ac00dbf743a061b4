"""Roles on shared processes: actor TP2 + critic TP1×DP2 colocated both train; the actor's (and the
reference's) log-probs equal transformers' on padded rows; the reward model scores; offload is lossless."""

import engine_cases as C
import pytest
import torch

from megarl.models.convert import mcore_to_hf
from megarl.models.hf_io import CheckpointError
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_roles")
    save_tiny_hf_model("qwen2", root / "actor", seed=2)
    save_tiny_hf_model("llama", root / "critic", seed=3)
    return str(root / "actor"), str(root / "critic")


def test_colocated_actor_tp2_and_critic_tp1_dp2_train_and_logprobs_match_transformers(models, tmp_path):
    actor_hf, critic_hf = models
    per_rank = run_distributed(C.colocated_rank, 2, actor_hf, critic_hf, 4, str(tmp_path), timeout=300)
    batch = C.padded_batch()
    mask = batch["response_mask"].bool()
    expected = C.hf_log_probs(actor_hf, batch)
    for result in per_rank:
        torch.testing.assert_close(result["start"]["old_log_probs"][mask], expected[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(result["ref"], result["start"]["old_log_probs"])
        assert result["start"]["entropy"][mask].gt(0).all()
        assert result["scores"].shape == (len(batch),) and result["scores"].isfinite().all()
        assert result["actor"][-1] < result["actor"][0], result["actor"]
        assert result["critic"][-1] < result["critic"][0], result["critic"]
        assert torch.equal(result["restored_values"], result["critic_values"])  # critic checkpoint round trip
    rows = [r["critic_rows"] for r in per_rank]
    assert sorted(map(len, rows)) == [4, 4] and not torch.equal(rows[0], rows[1])  # DP2 split the batch
    with pytest.raises(CheckpointError, match="value model's checkpoint"):  # not exported as a causal LM
        mcore_to_hf(tmp_path / "critic", tmp_path / "critic_hf")
    assert not (tmp_path / "critic_hf").exists()


def test_offload_then_onload_leaves_training_identical_and_a_role_can_span_one_rank(models):
    per_rank = run_distributed(C.offload_rank, 2, models[0], 3, timeout=300)
    curves, freed, weights, _ = per_rank[0]
    assert per_rank[0][3] == (0, None)  # rank 0 is not part of the one-rank reward model
    assert per_rank[1][3][0] == 1 and per_rank[1][3][1].shape == (8,) and per_rank[1][3][1].isfinite().all()
    assert curves[0] == curves[1]
    assert all(f == 0 for f in freed), freed  # nothing the engine owns kept its storage while offloaded
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
