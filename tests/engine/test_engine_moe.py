"""A MoE actor update with expert parallelism equals the same update without it.

Qwen2-MoE (routed experts + shared expert) on 2 ranks: DP2 vs DP2 with EP2 (each rank holds 2 of
the 4 experts; the engine's process-group collection carries the ep / expt_dp groups that
megatron's MoE layer, DDP and distributed optimizer use). With the linear Adam of engine_cases the
parameter deltas are the gradient, so equal deltas mean equal gradients for every expert.
"""
import torch

from megarl.models.layout import ParallelLayout as L
from megarl.testing.dist import run_distributed
from megarl.testing.models import save_tiny_hf_model

import engine_cases as C


def test_moe_update_with_ep2_equals_update_without_ep(tmp_path):
    save_tiny_hf_model("qwen2_moe", tmp_path, seed=1)  # a seed whose router sends tokens to all 4 experts
    per_rank = run_distributed(C.updates_rank, 2, [(str(tmp_path), L(), 1000), (str(tmp_path), L(ep=2), 1000)],
                               timeout=300)
    (loss, grad_norm, _, deltas), (loss_ep, grad_norm_ep, _, deltas_ep) = per_rank[0]
    assert loss == loss_ep and abs(grad_norm - grad_norm_ep) < 1e-6 * grad_norm
    assert set(deltas) == set(deltas_ep) and any(".experts.3." in n for n in deltas_ep)  # every expert exported
    assert all(deltas[n].abs().max() > 1e-5 for n in deltas if ".experts." in n)  # every expert got tokens
    for name, delta in deltas.items():
        assert (deltas_ep[name] - delta).abs().max() <= 1e-4 * delta.abs().max() + 1e-9, name
