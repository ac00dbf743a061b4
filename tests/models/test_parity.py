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


def bf16_parameter_dtypes_and_warnings(hf_path):
    import warnings

    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron

    init_megatron(ParallelLayout())
    chunk = ModelBridge.from_hf_path(hf_path, ParallelLayout(), dtype=torch.bfloat16).build(0)[0]
    dtypes = {name: p.dtype for name, p in chunk.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunk(torch.randint(0, 90, (1, 8)), torch.arange(8).unsqueeze(0), None)
    return dtypes, [str(w.message) for w in caught]


def test_a_bf16_model_holds_every_parameter_in_bf16(tiny_models):
    """The local spec's torch norms are created in float32; left so, torch falls back from its fused
    norm on every call of a bf16 model (found on an H200) and they would train and sync as float32."""
    from megarl.testing.dist import run_distributed

    dtypes, warnings = run_distributed(bf16_parameter_dtypes_and_warnings, 1, str(tiny_models["qwen3"]))[0]
    assert any("layernorm" in name for name in dtypes)  # qwen3: input, pre-MLP and q/k norms
    assert {name: d for name, d in dtypes.items() if d != torch.bfloat16} == {}
    assert not [w for w in warnings if "Mismatch dtype" in w], warnings
