"""HuggingFace `config.json` → a normalised description of a decoder-only model.

Owns: the registry of supported architectures (Llama incl. Llama-3 RoPE scaling, Mistral,
Qwen2/2.5, Qwen3) and `describe_hf_config`, which validates a config and returns `ModelDims`.
Everything here is checked before any weight is read. Must not import megatron, vLLM or Ray.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """The HuggingFace config names an architecture or feature megarl cannot convert exactly."""


@dataclass(frozen=True)
class ModelDims:
    """What megarl needs to know of a dense decoder-only transformer, whatever its HF family."""

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


_ARCH_FLAGS: dict[str, Callable[[Any], dict]] = {}
_SUPPORTED_ROPE = ("default", "llama3", "linear")


def register_architecture(model_type: str):
    """Register a function `hf_config -> {"qkv_bias": bool, "qk_norm": bool}` for `model_type`."""

    def wrap(fn):
        _ARCH_FLAGS[model_type] = fn
        return fn

    return wrap


def supported_model_types() -> list[str]:
    return sorted(_ARCH_FLAGS)


@register_architecture("llama")
def _llama(cfg) -> dict:
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("llama config with mlp_bias=true is not supported (megatron-core adds"
                                    " bias to every linear layer or none)")
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
    if model_type not in _ARCH_FLAGS:
        raise UnsupportedModelError(
            f"{cfg_file}: model_type={model_type!r} is not supported; supported: {supported_model_types()}"
        )
    return AutoConfig.from_pretrained(cfg_file.parent)


def _rope(cfg) -> tuple[float, str]:
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE:
        raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE)}")
    return float(theta), rope_type


def describe_hf_config(cfg) -> ModelDims:
    """Validate a `transformers` config and return its `ModelDims` (raises `UnsupportedModelError`)."""
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
