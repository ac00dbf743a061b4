"""Megatron-core models built by the bridge give the logits of `transformers` (fp32, ≤ 1e-4)."""

import pytest
import torch

from megarl.models.layout import ParallelLayout
from megarl.models.parity import check_parity_many
from megarl.models.spec import hf_rope_inv_freq
from megarl.testing.models import ARCHS

ATOL = 1e-4


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["tp1", "tp2", "pp2", "tp2xpp2"])
def test_logits_match_transformers_for_every_family(tiny_models, tp, pp):
    names = list(ARCHS) + ["llama3_rope"]
    results = check_parity_many([tiny_models[n] for n in names], ParallelLayout(tp=tp, pp=pp), atol=ATOL)
    failures = {n: str(r) for n, r in zip(names, results) if not r.ok}
    assert not failures, failures


def test_logits_match_with_virtual_pipeline_stages(tiny_models):
    names = ["qwen2_4layers", "qwen3_4layers"]
    results = check_parity_many([tiny_models[n] for n in names], ParallelLayout(tp=1, pp=2, vpp=2), atol=ATOL)
    assert all(r.ok for r in results), [str(r) for r in results]


def test_llama3_rope_scaling_changes_frequencies(tiny_models):
    """The Llama-3 case above only proves something if its scaled frequencies differ from plain RoPE."""
    from transformers import AutoConfig

    inv_freq = hf_rope_inv_freq(AutoConfig.from_pretrained(tiny_models["llama3_rope"]))
    head_dim = 16
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert inv_freq is not None and not torch.allclose(inv_freq, plain)
    assert hf_rope_inv_freq(AutoConfig.from_pretrained(tiny_models["llama"])) is None
