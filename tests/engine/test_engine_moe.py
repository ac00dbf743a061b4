"""A MoE actor update with expert parallelism equals the same update without it.

Qwen2-MoE (routed experts + shared expert) on 2 ranks: DP2 vs DP2 with EP2 (each rank holds 2 of
the 4 experts; the engine's process-group collection carries the ep / expt_dp groups that
megatron's MoE layer, DDP and distributed optimizer use). With the linear Adam of engine_cases the
parameter deltas are the gradient, so equal deltas mean equal gradients for every expert.
"""

import engine_cases as C
import torch

from megarl.models.layout import ParallelLayout as L
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model


def test_moe_update_with_ep2_equals_update_without_ep(tmp_path):
    save_tiny_hf_model("qwen2_moe", tmp_path, seed=1)  # a seed whose router sends tokens to all 4 experts
    per_rank = run_distributed(
        C.updates_rank, 2, [(str(tmp_path), L(), 1000), (str(tmp_path), L(ep=2), 1000)], timeout=300
    )
    (loss, grad_norm, _, deltas), (loss_ep, grad_norm_ep, _, deltas_ep) = per_rank[0]
    assert loss == loss_ep and abs(grad_norm - grad_norm_ep) < 1e-6 * grad_norm
    assert set(deltas) == set(deltas_ep) and any(".experts.3." in n for n in deltas_ep)  # every expert exported
    assert all(deltas[n].abs().max() > 1e-5 for n in deltas if ".experts." in n)  # every expert got tokens
    for name, delta in deltas.items():
        assert (deltas_ep[name] - delta).abs().max() <= 1e-4 * delta.abs().max() + 1e-9, name


def test_moe_checkpoint_at_ep2_resumes_bit_exact_and_loads_at_ep1(tmp_path):
    """Qwen3-MoE actor at EP2 (DP2): one step, save, one more step. Resumed at EP2 the step repeats bit for
    bit; loaded at EP1 (DP2, experts are ordinary parameters of a single optimizer instead of a second,
    chained one) the weights are equal and the step matches in fp32, expert Adam moments included. A
    checkpoint saved at EP1 loads at EP2 the same way."""
    save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=1)
    r = run_distributed(C.moe_checkpoint_rank, 2, str(tmp_path / "hf"), str(tmp_path), timeout=300)[0]
    ((loss, norm, lr),) = r["rest"]
    assert loss != r["first"][0][0] and lr != r["first"][0][2]  # the step depends on the weights and the LR schedule
    assert r["ep2"]["steps"] == r["rest"]  # loss, grad norm, lr: bit for bit
    for name, tensor in r["final"].items():
        assert torch.equal(r["ep2"]["loaded"][name], r["saved"][name]), name
        assert torch.equal(r["ep2"]["final"][name], tensor), name
    ((loss1, norm1, lr1),) = r["ep1"]["steps"]
    assert abs(loss1 - loss) <= 1e-6 * abs(loss) and abs(norm1 - norm) <= 1e-6 * norm and lr1 == lr
    experts = [n for n in r["final"] if ".experts." in n]
    assert {n.split(".experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    for name, tensor in r["final"].items():
        assert torch.equal(r["ep1"]["loaded"][name], r["saved"][name]), name
        step = (tensor - r["saved"][name]).abs().max()
        assert step > 1e-3 or ".experts." not in name, name  # every expert was updated by the step
        # The second Adam step depends on the first one's moments: lost or misplaced expert state shows here.
        assert (r["ep1"]["final"][name] - tensor).abs().max() <= 1e-3 * step + 1e-7, name
    # And back: saved at EP1 (one optimizer), loaded at EP2 (dense + expert optimizers), the next step agrees.
    ((loss2, norm2, lr2),) = r["ep1"]["next"]["steps"]
    ((loss_back, norm_back, lr_back),) = r["back"]["steps"]
    assert abs(loss_back - loss2) <= 1e-6 * abs(loss2) and abs(norm_back - norm2) <= 1e-6 * norm2 and lr_back == lr2
    for name, tensor in r["ep1"]["next"]["final"].items():
        assert torch.equal(r["back"]["loaded"][name], r["ep1"]["final"][name]), name
        step = (tensor - r["ep1"]["final"][name]).abs().max()
        assert (r["back"]["final"][name] - tensor).abs().max() <= 1e-3 * step + 1e-7, name
