"""Save at step k, resume in a fresh engine: later steps equal the uninterrupted run bit for bit;
resuming at another layout works; a crashed save publishes nothing; HF export equals the actor; the
checkpoint converts to HF (`megarl convert mcore-to-hf`) with the weights it saved."""

import json

import engine_cases as C
import pytest
import torch
from safetensors.torch import load_file

from megarl.models.convert import MARKER, mcore_to_hf
from megarl.models.layout import ParallelLayout
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model


def test_resume_is_bit_exact_reshards_to_pp2_and_saves_atomically(tmp_path):
    hf = tmp_path / "llama"
    save_tiny_hf_model("llama", hf, seed=4)
    result = run_distributed(C.checkpoint_rank, 2, str(hf), str(tmp_path), 2, 4, timeout=300)[0]
    assert result["again"] == result["rest"]  # loss, grad norm and lr of steps 3 and 4, bit for bit
    assert result["same_weights"]
    assert result["meta"]["step"] == 2 and result["step_after_load"] == 2
    assert result["rest"][0][2] != result["first"][0][2]  # the LR schedule moved and was restored
    loss, norm, lr = result["other"][0]
    assert loss == pytest.approx(result["rest"][0][0], rel=1e-5)
    assert norm == pytest.approx(result["rest"][0][1], rel=1e-4) and lr == result["rest"][0][2]
    assert "CheckpointError" in result["changed_error"] and "same OptimConfig" in result["changed_error"]
    assert result["crashed"] and result["leftovers"] == []
    assert json.loads((tmp_path / "ckpt" / MARKER).read_text())["step"] == 2  # the old checkpoint survived

    batch = C.padded_batch()
    mask = batch["response_mask"].bool()
    exported = C.hf_log_probs(tmp_path / "hf_export", batch)
    torch.testing.assert_close(exported[mask], result["final_logp"][mask], rtol=0, atol=1e-5)

    # the trainer's checkpoint (optimizer state beside the model, no dtype in its marker) converts to HF:
    # in one process without megatron-core (TP1) and on megatron ranks (TP2), both the weights at the save
    for name, layout in (("ckpt_hf_tp1", ParallelLayout()), ("ckpt_hf_tp2", ParallelLayout(tp=2))):
        mcore_to_hf(tmp_path / "ckpt", tmp_path / name, layout)
        weights = {k: v for f in (tmp_path / name).glob("*.safetensors") for k, v in load_file(f).items()}
        assert set(weights) == set(result["saved"])
        assert all(torch.equal(weights[k], result["saved"][k]) for k in weights), name


def test_an_asynchronous_save_holds_the_state_at_the_save_while_training_goes_on(tmp_path):
    hf = tmp_path / "llama"
    save_tiny_hf_model("llama", hf, seed=4)
    result = run_distributed(C.async_checkpoint_rank, 2, str(hf), str(tmp_path), timeout=300)[0]
    assert not result["published_early"] and result["finished_while_held"] is False and result["finished"]
    # resumed from either checkpoint, steps 3 and 4 equal the uninterrupted run's, bit for bit
    assert result["resumed"]["async"] == result["resumed"]["sync"] == result["rest"]
    # and the model weights it holds are those of the save, not the later ones training wrote meanwhile
    # (a resume alone would not show it: megatron's distributed optimizer restores them from its own copy)
    exported = {}
    for name in ("sync", "async"):
        mcore_to_hf(tmp_path / name, tmp_path / f"{name}_hf", ParallelLayout())
        exported[name] = {
            k: v for f in (tmp_path / f"{name}_hf").glob("*.safetensors") for k, v in load_file(f).items()
        }
    assert exported["async"].keys() == exported["sync"].keys()
    assert all(torch.equal(exported["async"][k], exported["sync"][k]) for k in exported["sync"])
    assert "simulated disk error" in result["failure"]
    assert result["leftovers"] == [] and result["after"]


def test_a_dp_sharded_optimizer_checkpoint_resumes_at_any_dp_and_refuses_another_tp(tmp_path):
    hf = tmp_path / "llama"
    save_tiny_hf_model("llama", hf, seed=4)
    result = run_distributed(C.dp_sharded_checkpoint_rank, 2, str(hf), str(tmp_path), timeout=300)[0]
    assert result["format"] == "dp_reshardable"
    assert result["again"] == result["rest"]  # loss, grad norm and lr of steps 3 and 4, bit for bit
    assert result["refused"].startswith("CheckpointError: ") and "(tp 1 -> 2)" in result["refused"]
    assert "load it at that layout (any DP size)" in result["refused"] and result["untouched"]
    dp1 = run_distributed(C.dp_sharded_resume_rank, 1, str(hf), str(tmp_path), timeout=300)[0]
    for (loss, norm, lr), (loss2, norm2, lr2) in zip(dp1, result["rest"]):
        assert loss == pytest.approx(loss2, rel=1e-5) and norm == pytest.approx(norm2, rel=1e-4) and lr == lr2
