"""Tiny HuggingFace models built from configs (no download) for tests, benchmarks and demos.

Owns: `tiny_hf_config` / `save_tiny_hf_model`, one config per supported family, 2 layers and
hidden 64 by default (MoE families: 4 experts, top-2), saved with `save_pretrained` as safetensors.
Imports transformers only.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
"""Qwen3-MoE renormalises its top-k probabilities here (as Qwen3-30B-A3B does), Qwen2-MoE does not."""
_MOE_EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        head_dim=32,
        use_sliding_window=False,
    ),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=False,
        shared_expert_intermediate_size=96,
        use_sliding_window=False,
    ),
}


def tiny_hf_config(
    arch: str,
    *,
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict | None = None,
    **extra,
):
    """A tiny config of family `arch`; Qwen2 ties embeddings by default, as its small models do."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen2":
        common.update(tie_word_embeddings=True, use_sliding_window=False)
    elif arch == "qwen3":
        common.update(head_dim=32, tie_word_embeddings=False, use_sliding_window=False)
    elif arch == "mistral":
        common.update(sliding_window=None, head_dim=hidden_size // num_heads)
    elif arch == "llama":
        common.update(tie_word_embeddings=False)
    elif arch in _MOE_EXTRA:
        common.update(tie_word_embeddings=False, **_MOE_EXTRA[arch])
    if tie_word_embeddings is not None:
        common["tie_word_embeddings"] = tie_word_embeddings
    if rope_scaling is not None:
        common["rope_parameters"] = {"rope_theta": 500000.0, **rope_scaling}
    common.update(extra)
    return AutoConfig.for_model(arch, **common)


def save_tiny_policy(path: str | Path, tokenizer, *, seed: int = 0, **config_kwargs):
    """The tests' tiny policy: a Qwen2 with 2 heads of 32 (hidden 64; vLLM needs head_dim >= 32) sized to
    `tokenizer` (vocabulary and special token ids), saved with it to `path`; `config_kwargs` override."""
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=2)
    save_tiny_hf_model("qwen2", path, seed=seed, tokenizer=tokenizer, **{**sizes, **ids, **config_kwargs})


def save_tiny_hf_model(arch: str, path: str | Path, *, seed: int = 0, tokenizer=None, **config_kwargs):
    """Build a randomly initialised tiny model of family `arch` and `save_pretrained` it to `path`."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms(model, seed)
    model.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return model


def _perturb_norms(model, seed: int) -> None:
    """Norm weights start at 1.0 (and biases at 0); randomise them so a wrong mapping cannot hide.

    MoE routers (and the shared-expert gate) get large weights: routing is then decisive (no near
    ties that rounding could flip). Expert weights are scaled up 10x so the MoE output is not lost
    in the residual stream: a wrong expert, order or routing normalisation moves the logits a lot.
    MoE biases are centred on 0: a value bias near 1 adds one common vector to every token, and
    the router would then send all tokens to the same experts.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    moe = model.config.model_type in _MOE_EXTRA
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                centre = 0.0 if moe and name.endswith(".bias") else 1.0
                param.copy_(centre + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif ".experts." in name or ".shared_expert." in name:
                param.mul_(10.0)
