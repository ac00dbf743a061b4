"""HuggingFace `config.json` → a normalised description of a decoder-only model.

Owns: the registry of supported architectures (dense: Llama incl. Llama-3 RoPE scaling, Mistral,
Qwen2/2.5, Qwen3; mixture-of-experts: Mixtral, Qwen2-MoE, Qwen3-MoE) and `describe_hf_config`, which
validates a config and returns `ModelDims` (with `MoEDims` for MoE families). Known-but-unsupported
families (DeepSeek's multi-latent attention) are refused with the reason. Everything here is
checked before any weight is read. Must not import megatron, vLLM or Ray.

MoE routing, as HF computes it: softmax over all experts, top-k, then (`norm_topk_prob`, always
for Mixtral) renormalise the k probabilities. megatron-core's "top-k of the logits, then softmax"
(`moe_router_pre_softmax=False`) is the renormalised variant; "softmax, then top-k"
(`moe_router_pre_softmax=True`) is the unnormalised one. The auxiliary load-balancing loss:
transformers adds `router_aux_loss_coef * aux` only when `output_router_logits` is true (false in
the released Mixtral/Qwen-MoE configs), so `MoEDims.aux_loss_coef` is that coefficient or 0.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """The HuggingFace config names an architecture or feature megarl cannot convert exactly."""


@dataclass(frozen=True)
class MoEDims:
    """The mixture-of-experts MLP of every layer (all layers are MoE layers)."""

    num_experts: int
    topk: int
    """Experts per token (`num_experts_per_tok`)."""
    ffn_hidden_size: int
    """Intermediate size of one routed expert."""
    norm_topk_prob: bool
    """Renormalise the top-k routing probabilities to sum to 1."""
    shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the always-on shared expert (0: none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(hidden @ gate) (Qwen2-MoE)."""
    aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient used in training (0: none); see the module docstring."""
    jitter_eps: float = 0.0
    """Multiplicative input jitter of the router in training (Mixtral `router_jitter_noise`)."""


@dataclass(frozen=True)
class ModelDims:
    """What megarl needs to know of a decoder-only transformer, whatever its HF family."""

    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_type: str
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEDims | None = None
    """None for dense models."""

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0


_ARCH_FLAGS: dict[str, Callable[[Any], dict]] = {}
_SUPPORTED_ROPE = ("default", "llama3", "linear")


def register_architecture(model_type: str):
    """Register a function `hf_config -> {"qkv_bias": bool, "qk_norm": bool[, "moe": MoEDims]}` for `model_type`."""

    def wrap(fn):
        _ARCH_FLAGS[model_type] = fn
        return fn

    return wrap


def supported_model_types() -> list[str]:
    return sorted(_ARCH_FLAGS)


@register_architecture("llama")
def _llama(cfg) -> dict:
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError(
            "llama config with mlp_bias=true is not supported (megatron-core adds bias to every linear layer or none)"
        )
    return {"qkv_bias": bool(getattr(cfg, "attention_bias", False)), "qk_norm": False}


@register_architecture("mistral")
def _mistral(cfg) -> dict:
    _reject_sliding_window(cfg)
    return {"qkv_bias": False, "qk_norm": False}


@register_architecture("qwen2")
def _qwen2(cfg) -> dict:
    if getattr(cfg, "use_sliding_window", False):
        _reject_sliding_window(cfg)
    return {"qkv_bias": True, "qk_norm": False}


@register_architecture("qwen3")
def _qwen3(cfg) -> dict:
    if getattr(cfg, "use_sliding_window", False):
        _reject_sliding_window(cfg)
    if getattr(cfg, "attention_bias", False):
        raise UnsupportedModelError("qwen3 config with attention_bias=true is not supported")
    return {"qkv_bias": False, "qk_norm": True}


@register_architecture("mixtral")
def _mixtral(cfg) -> dict:
    _reject_sliding_window(cfg)
    moe = _moe_dims(
        cfg,
        num_experts=cfg.num_local_experts,
        ffn_hidden_size=cfg.intermediate_size,
        norm_topk_prob=True,
        jitter_eps=float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0),
    )
    return {"qkv_bias": False, "qk_norm": False, "moe": moe}


@register_architecture("qwen3_moe")
def _qwen3_moe(cfg) -> dict:
    flags = _qwen3(cfg)
    _reject_mixed_layers(cfg)
    moe = _moe_dims(
        cfg,
        num_experts=cfg.num_experts,
        ffn_hidden_size=cfg.moe_intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob),
    )
    return {**flags, "moe": moe}


@register_architecture("qwen2_moe")
def _qwen2_moe(cfg) -> dict:
    if getattr(cfg, "use_sliding_window", False):
        _reject_sliding_window(cfg)
    _reject_mixed_layers(cfg)
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    moe = _moe_dims(
        cfg,
        num_experts=cfg.num_experts,
        ffn_hidden_size=cfg.moe_intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
    )
    return {"qkv_bias": bool(getattr(cfg, "qkv_bias", True)), "qk_norm": False, "moe": moe}


def _moe_dims(cfg, **fields) -> MoEDims:
    topk = cfg.num_experts_per_tok
    if not 0 < topk <= fields["num_experts"]:
        raise UnsupportedModelError(
            f"num_experts_per_tok={topk} must be in 1..{fields['num_experts']} (the number of experts)"
        )
    if topk == 1 and fields["norm_topk_prob"]:
        raise UnsupportedModelError(
            "num_experts_per_tok=1 with norm_topk_prob=true (routing weight always 1) is not"
            " supported: megatron-core's top-1 router needs the unnormalised softmax"
        )
    coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    return MoEDims(topk=topk, aux_loss_coef=coef if getattr(cfg, "output_router_logits", False) else 0.0, **fields)


def _reject_mixed_layers(cfg) -> None:
    step, dense_layers = getattr(cfg, "decoder_sparse_step", 1), getattr(cfg, "mlp_only_layers", None) or []
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"decoder_sparse_step={step}, mlp_only_layers={list(dense_layers)}: models that mix dense and MoE layers"
            " are not supported yet (every layer must be an MoE layer: decoder_sparse_step=1, mlp_only_layers=[])"
        )


_KNOWN_UNSUPPORTED = {
    "deepseek_v2": "multi-latent attention (q_lora_rank/kv_lora_rank) and group-limited routing (n_group, topk_group)",
    "deepseek_v3": "multi-latent attention (q_lora_rank/kv_lora_rank), sigmoid routing with expert bias and"
    " first_k_dense_replace dense layers",
}
"""Families users ask for that megarl refuses, with what is missing."""


def _reject_sliding_window(cfg) -> None:
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        raise UnsupportedModelError(
            f"sliding_window={window} < max_position_embeddings={cfg.max_position_embeddings}: sliding-window"
            " attention is not supported yet; set sliding_window to null in config.json if the model was"
            " trained without it"
        )


def load_hf_config(path: str | Path):
    """Load a `transformers` config from a directory (or its config.json), with clear errors."""
    from transformers import AutoConfig

    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json at {cfg_file}: pass the directory of a HuggingFace checkpoint")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file} is not valid JSON ({err}); the checkpoint is corrupt") from err
    model_type = raw.get("model_type")
    _check_known_unsupported(model_type)
    if model_type not in _ARCH_FLAGS:
        raise UnsupportedModelError(
            f"{cfg_file}: model_type={model_type!r} is not supported; supported: {supported_model_types()}"
        )
    with _no_generated_docstrings():
        return AutoConfig.from_pretrained(cfg_file.parent)


_DOCSTRINGS_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_generated_docstrings():
    """Config classes imported in this block keep their own docstrings instead of generated ones.

    transformers decorates every config class with `auto_docstring`, and generating a class's docstring
    imports the model mappings (`modeling_auto` → `generation` → torch._dynamo): 1.3 s of CPU the first time
    a config is loaded, in a driver or rank that builds no `transformers` model (the quickstart's driver spent
    it checking the model before Ray started). Nothing reads the text; the classes and their defaults are
    the same. A transformers without the hook (renamed) loads as before, generating them."""
    try:
        docstrings = importlib.import_module("transformers.utils.auto_docstring")
        generate = docstrings.auto_class_docstring
    except (ImportError, AttributeError):
        yield
        return
    with _DOCSTRINGS_LOCK:
        docstrings.auto_class_docstring = _plain_class
        try:
            yield
        finally:
            docstrings.auto_class_docstring = generate


def _plain_class(cls, custom_intro=None, custom_args=None, checkpoint=None):
    return cls


def _check_known_unsupported(model_type) -> None:
    if model_type in _KNOWN_UNSUPPORTED:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported yet: {_KNOWN_UNSUPPORTED[model_type]}"
            f" have no bridge mapping; supported: {supported_model_types()}"
        )


def _rope(cfg) -> tuple[float, str]:
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE:
        raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE)}")
    return float(theta), rope_type


def describe_hf_config(cfg) -> ModelDims:
    """Validate a `transformers` config and return its `ModelDims` (raises `UnsupportedModelError`)."""
    _check_known_unsupported(cfg.model_type)
    if cfg.model_type not in _ARCH_FLAGS:
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} is not supported; supported: {supported_model_types()}"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={cfg.hidden_act!r} is not supported (only silu/SwiGLU)")
    flags = _ARCH_FLAGS[cfg.model_type](cfg)
    theta, rope_type = _rope(cfg)
    num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if cfg.num_attention_heads % num_kv:
        raise UnsupportedModelError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of num_key_value_heads={num_kv}"
        )
    architectures = getattr(cfg, "architectures", None) or ["?"]
    return ModelDims(
        model_type=cfg.model_type,
        architecture=architectures[0],
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=theta,
        rope_type=rope_type,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        **flags,
    )
