"""GPU only (2 GPUs + Transformer Engine): an actor update at CP=2 equals CP=1 — loss, grad norm, every
weight's gradient, log-probs — with TE's real context-parallel attention (p2p ring, causal, bf16).

Skips itself elsewhere. Gradients are read as parameter deltas of a first Adam step with ε ≫ |g| and
lr = ε (≈ −g; see engine_cases.linear_adam). bf16 on both sides (TE's CP attention has no fp32
kernel), so the comparison allows bf16 noise: per-tensor relative error of the deltas, not equality.
Run: `PYTHONPATH=$PWD python -m pytest tests/engine/test_context_parallel_gpu.py` on a 2-GPU machine.
"""

import cp_cases
import engine_cases as C
import pytest
import torch

from megarl.models.layout import ParallelLayout as L
from megarl.models.spec import te_available
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not te_available(),
    reason="needs 2 CUDA GPUs and Transformer Engine (context-parallel attention)",
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp_gpu") / "llama"
    save_tiny_hf_model("llama", path, seed=0, hidden_size=128, intermediate_size=256)
    return str(path)


def _relative_error(ours, ref):
    return float((ours - ref).norm() / ref.norm().clamp(min=1e-12))


def _assert_close_bf16(result, reference):
    loss, norm, _, deltas, log_probs = result
    ref_loss, ref_norm, _, ref_deltas, ref_log_probs = reference
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert norm == pytest.approx(ref_norm, rel=3e-2)
    assert deltas.keys() == ref_deltas.keys()
    worst = {name: _relative_error(deltas[name], ref_deltas[name]) for name in ref_deltas}
    assert max(worst.values()) < 5e-2, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    mask = cp_cases.gpu_batch()["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], ref_log_probs[mask], rtol=0, atol=5e-2)


@pytest.mark.parametrize(
    "micro_batch_tokens, loss",
    [(4096, None), (120, C.full_actor_loss())],
    ids=["one-micro-batch-ppo", "micro-batches-ppo-kl-entropy-seq-mean"],
)
def test_actor_update_cp2_equals_cp1_with_te_attention(llama, micro_batch_tokens, loss):
    cp1 = run_distributed(cp_cases.gpu_update_rank, 1, llama, L(), micro_batch_tokens, loss, timeout=600)[0]
    cp2 = run_distributed(cp_cases.gpu_update_rank, 2, llama, L(cp=2), micro_batch_tokens, loss, timeout=600)
    assert max(d.abs().max() for d in cp1[3].values()) > 1e-4  # a real update
    if micro_batch_tokens < 4096:
        assert cp2[0][2] > 1
    for rank_result in cp2:  # both CP ranks hold the same (replicated) weights and report the same rows
        _assert_close_bf16(rank_result, cp1)
