"""MoE families (Mixtral, Qwen3-MoE, Qwen2-MoE) in the bridge, with expert parallelism (EP).

Parity: logits of megatron-core's MoE layers equal `transformers` (fp32, ≤ 1e-4) at TP1, EP2, TP2
and TP2×EP2. The tiny models route decisively and have 10x expert weights (megarl.testing.models),
so a wrong EP offset (0.7-0.9) or router normalisation (5e-2) moves the logits far past the tolerance.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.convert import hf_to_mcore, mcore_to_hf
from megarl.models.hf_config import UnsupportedModelError, describe_hf_config, load_hf_config
from megarl.models.layout import LayoutError, ParallelLayout
from megarl.models.parity import check_parity_many
from megarl.models.weight_map import WeightMap
from megarl.testing.models import MOE_ARCHS, tiny_hf_config

ATOL = 1e-4


def _dims(path):
    return describe_hf_config(load_hf_config(path))


def test_describe_moe_families_routing_and_shared_expert():
    mixtral, qwen3, qwen2 = (describe_hf_config(tiny_hf_config(a)).moe for a in MOE_ARCHS)
    assert (mixtral.num_experts, mixtral.topk, mixtral.ffn_hidden_size, mixtral.norm_topk_prob) == (4, 2, 64, True)
    assert qwen3.norm_topk_prob and not qwen3.shared_expert_ffn_hidden_size
    assert not qwen2.norm_topk_prob and (qwen2.shared_expert_ffn_hidden_size, qwen2.shared_expert_gate) == (96, True)
    assert describe_hf_config(tiny_hf_config("llama")).moe is None
    # transformers adds the aux loss only with output_router_logits: so does megarl
    assert mixtral.aux_loss_coef == 0.0
    assert describe_hf_config(tiny_hf_config("mixtral", output_router_logits=True)).moe.aux_loss_coef == 0.001


def test_moe_transformer_config_matches_hf_routing():
    from megarl.models.spec import moe_config_kwargs

    mixtral = moe_config_kwargs(describe_hf_config(tiny_hf_config("mixtral")))
    qwen2 = moe_config_kwargs(describe_hf_config(tiny_hf_config("qwen2_moe")))
    assert mixtral["moe_router_pre_softmax"] is False and qwen2["moe_router_pre_softmax"] is True
    assert (qwen2["moe_shared_expert_intermediate_size"], qwen2["moe_shared_expert_gate"]) == (96, True)
    assert mixtral["moe_router_load_balancing_type"] == "none" and mixtral["moe_aux_loss_coeff"] == 0.0


def test_unsupported_moe_variants_name_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    with pytest.raises(UnsupportedModelError, match="deepseek_v3.*multi-latent attention"):
        load_hf_config(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"decoder_sparse_step=2"):
        describe_hf_config(tiny_hf_config("qwen3_moe", decoder_sparse_step=2))
    with pytest.raises(UnsupportedModelError, match=r"mlp_only_layers=\[0\]"):
        describe_hf_config(tiny_hf_config("qwen2_moe", mlp_only_layers=[0]))
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=1 with norm_topk_prob"):
        describe_hf_config(tiny_hf_config("mixtral", num_experts_per_tok=1))


def test_ep_must_divide_the_experts():
    dims = describe_hf_config(tiny_hf_config("mixtral"))
    ParallelLayout(ep=4).check_dims(dims)
    with pytest.raises(LayoutError, match="num_experts=4 is not divisible by ep=3"):
        ParallelLayout(ep=3).check_dims(dims)
    assert ParallelLayout(tp=2, ep=2).min_world_size == 4 and ParallelLayout(cp=2, ep=2).min_world_size == 2


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_weight_map_covers_exactly_the_hf_tensors(tiny_models, arch):
    hf_names = set(load_file(tiny_models[arch] / "model.safetensors"))
    assert set(WeightMap(_dims(tiny_models[arch])).hf_names()) == hf_names


def test_local_experts_map_to_global_experts_by_ep_rank(tiny_models):
    wmap = WeightMap(_dims(tiny_models["mixtral"]))
    local1 = "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    # EP2: rank 1 holds experts 2, 3 as local experts 0, 1
    fc1 = wmap.lookup(local1, layer_offset=1, expert_offset=1 * wmap.local_experts(2))
    assert fc1.expert and fc1.hf == (
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    )
    router = wmap.lookup("decoder.layers.0.mlp.router.weight", expert_offset=2)
    assert router.hf == ("model.layers.0.block_sparse_moe.gate.weight",) and not router.expert and router.tp_dim is None
    fc2 = WeightMap(_dims(tiny_models["qwen2_moe"])).lookup(
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    )
    assert fc2.hf == ("model.layers.1.mlp.experts.0.down_proj.weight",) and fc2.tp_dim == 1


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=["tp1", "ep2", "tp2", "tp2xep2"])
def test_moe_logits_match_transformers(tiny_models, tp, ep):
    results = check_parity_many([tiny_models[a] for a in MOE_ARCHS], ParallelLayout(tp=tp, ep=ep), atol=ATOL)
    failures = {a: str(r) for a, r in zip(MOE_ARCHS, results) if not r.ok}
    assert not failures, failures


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_hf_to_mcore_ep2_to_hf_is_bit_exact(tiny_models, tmp_path):
    """Qwen2-MoE (routed + shared expert + gate, qkv bias): written at EP2, exported at EP2 (experts
    gathered over EP) and at TP2 (megatron reshards the experts on load)."""
    src = tiny_models["qwen2_moe"]
    meta = hf_to_mcore(src, tmp_path / "mcore", ParallelLayout(ep=2))
    assert meta["written_with_layout"]["ep"] == 2
    reference = _tensors(src)
    for name, layout in (("hf_ep2", ParallelLayout(ep=2)), ("hf_tp2", ParallelLayout(tp=2))):
        summary = mcore_to_hf(tmp_path / "mcore", tmp_path / name, layout)
        exported = _tensors(tmp_path / name)
        assert summary["tensors"] == len(reference) and set(exported) == set(reference)
        different = [k for k in reference if not torch.equal(reference[k], exported[k])]
        assert not different, (name, different)


def test_convert_cli_takes_ep_and_refuses_one_that_does_not_divide_the_experts(tiny_models, tmp_path):
    from megarl.cli import _layout, build_parser
    from megarl.models.convert import plan_hf_to_mcore

    args = build_parser().parse_args(
        ["convert", "hf-to-mcore", "--hf-path", "a", "--mcore-path", "b", "--tp", "2", "--ep", "2"]
    )
    assert _layout(args) == ParallelLayout(tp=2, ep=2)
    assert plan_hf_to_mcore(tiny_models["mixtral"], tmp_path / "ok", _layout(args)).world_size == 4
    with pytest.raises(LayoutError, match="num_experts=4 is not divisible by ep=3"):
        plan_hf_to_mcore(tiny_models["mixtral"], tmp_path / "out", ParallelLayout(ep=3))
    with pytest.raises(LayoutError, match="ep=2 needs a mixture-of-experts model"):
        plan_hf_to_mcore(tiny_models["llama"], tmp_path / "out", ParallelLayout(ep=2))
