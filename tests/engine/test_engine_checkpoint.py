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
