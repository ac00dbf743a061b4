"""Model sizes the planner knows by name, for configs whose `model.hf_path` exists only on the cluster.

Owns: `PRESETS` (name -> `ModelDims`, from the models' published config.json values) and
`resolve_dims(path_or_name)`: a local HF directory / config.json is read with the normal checks
(`megarl.models.hf_config`); otherwise the path's last component (case-insensitive) or the name
itself is looked up here. `deepseek-v3-sized` is not DeepSeek-V3 (whose multi-latent attention
megarl does not convert): a Qwen3-MoE-style model of the same size class (61 layers, hidden 7168,
256 experts of width 2048, top-8, one shared expert; ~700B parameters), with 8 GQA KV heads standing
in for MLA's compressed cache. Imports megarl.models only.
"""

from __future__ import annotations

import os

from megarl.models.hf_config import ModelDims, MoEDims, describe_hf_config, load_hf_config


def _dense(
    model_type,
    layers,
    hidden,
    ffn,
    heads,
    kv,
    vocab,
    max_pos,
    theta,
    tied=False,
    qkv_bias=False,
    qk_norm=False,
    head_dim=None,
    moe=None,
) -> ModelDims:
    return ModelDims(
        model_type=model_type,
        architecture=model_type,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        norm_eps=1e-6,
        rope_theta=theta,
        rope_type="default",
        tie_word_embeddings=tied,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        moe=moe,
    )


PRESETS = {
    "qwen2.5-7b-instruct": _dense("qwen2", 28, 3584, 18944, 28, 4, 152064, 32768, 1e6, qkv_bias=True),
    "meta-llama-3-70b-instruct": _dense("llama", 80, 8192, 28672, 64, 8, 128256, 8192, 5e5),
    "llama-3.3-70b-instruct": _dense("llama", 80, 8192, 28672, 64, 8, 128256, 131072, 5e5),
    "qwen3-30b-a3b": _dense(
        "qwen3_moe",
        48,
        2048,
        6144,
        32,
        4,
        151936,
        40960,
        1e6,
        qk_norm=True,
        head_dim=128,
        moe=MoEDims(num_experts=128, topk=8, ffn_hidden_size=768, norm_topk_prob=True),
    ),
    "deepseek-v3-sized": _dense(
        "qwen3_moe",
        61,
        7168,
        18432,
        128,
        8,
        129280,
        163840,
        1e4,
        head_dim=128,
        moe=MoEDims(
            num_experts=256, topk=8, ffn_hidden_size=2048, norm_topk_prob=True, shared_expert_ffn_hidden_size=2048
        ),
    ),
}
PRESETS["qwen2.5-7b"] = PRESETS["qwen2.5-7b-instruct"]
PRESETS["meta-llama-3-70b"] = PRESETS["meta-llama-3-70b-instruct"]


def resolve_dims(path_or_name: str) -> ModelDims:
    """`ModelDims` of a local HF checkpoint (dir or config.json), else of the preset its basename names."""
    if os.path.isdir(path_or_name) or os.path.isfile(path_or_name):
        return describe_hf_config(load_hf_config(path_or_name))
    key = os.path.basename(os.path.normpath(path_or_name)).lower()
    if key in PRESETS:
        return PRESETS[key]
    raise ValueError(
        f"model {path_or_name!r}: no config.json there and not a known preset; pass --hf-config"
        f" with a HuggingFace directory / config.json, or a preset: {', '.join(sorted(PRESETS))}"
    )
