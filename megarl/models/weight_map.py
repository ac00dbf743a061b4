"""The weight map of one model: which `Mapping` each megatron-core parameter has, by name.

Owns: the per-family name tables (a transformer layer's dense or MoE block, the embedding, final
norm and output layer or value head; `MOE_HF_NAMES` per MoE family), `WeightMap` (lookup of a
chunk-local megatron name, with layer and expert offsets made global; every mapping of the model
in HF order) and `canonical_name` (DDP / Float16 wrappers and Transformer Engine's fused-norm
names). A new architecture is a new table here; the split/merge rules are `mapping.py`'s.
Pure torch: must not import megatron, vLLM or Ray (the sharding planner uses it too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megarl.models.hf_config import ModelDims
from megarl.models.mapping import EXPERT, GateUpMapping, Mapping, QKVMapping, VocabMapping

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer.
TE_NAME_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass(frozen=True)
class MoENames:
    """HF names (under `model.layers.{layer}.`) of one family's MoE block; `{expert}` is the expert number."""

    router: str
    gate: str
    up: str
    down: str
    shared_prefix: str = "mlp.shared_expert."
    shared_gate: str = "mlp.shared_expert_gate.weight"


_QWEN_MOE = MoENames(
    "mlp.gate.weight",
    "mlp.experts.{expert}.gate_proj.weight",
    "mlp.experts.{expert}.up_proj.weight",
    "mlp.experts.{expert}.down_proj.weight",
)
MOE_HF_NAMES = {
    "mixtral": MoENames(
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{expert}.w1.weight",
        "block_sparse_moe.experts.{expert}.w3.weight",
        "block_sparse_moe.experts.{expert}.w2.weight",
    ),
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
}
"""A new MoE family is a new row (names as `save_pretrained` writes them and vLLM loads them)."""

_HF, _MC = "model.layers.{layer}.", "decoder.layers.{layer}."


def _dense_mlp_table(hf: str, mc: str) -> list[Mapping]:
    """SwiGLU MLP `hf` (an HF module prefix with gate/up/down_proj) as megatron MLP `mc`."""
    return [
        GateUpMapping(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight")),
        Mapping(mc + "linear_fc2.weight", (hf + "down_proj.weight",), tp_dim=1),
    ]


def _moe_table(dims: ModelDims) -> list[Mapping]:
    if dims.model_type not in MOE_HF_NAMES:
        raise KeyError(f"no MoE name table for model_type={dims.model_type!r}; add a row to MOE_HF_NAMES")
    names, experts = MOE_HF_NAMES[dims.model_type], _MC + "mlp.experts.local_experts.{expert}."
    table = [
        Mapping(_MC + "mlp.router.weight", (_HF + names.router,)),
        GateUpMapping(experts + "linear_fc1.weight", (_HF + names.gate, _HF + names.up), expert=True),
        Mapping(experts + "linear_fc2.weight", (_HF + names.down,), tp_dim=1, expert=True),
    ]
    if dims.moe.shared_expert_ffn_hidden_size:
        table += _dense_mlp_table(_HF + names.shared_prefix, _MC + "mlp.shared_experts.")
    if dims.moe.shared_expert_gate:
        table.append(Mapping(_MC + "mlp.shared_experts.gate_weight", (_HF + names.shared_gate,)))
    return table


def _layer_table(dims: ModelDims) -> list[Mapping]:
    hf, mc = _HF, _MC
    attn = hf + "self_attn."
    table = [
        Mapping(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
        QKVMapping(mc + "self_attention.linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv")),
        Mapping(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp_dim=1),
        Mapping(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
    ]
    table += _moe_table(dims) if dims.moe else _dense_mlp_table(hf + "mlp.", mc + "mlp.")
    if dims.qkv_bias:
        table.append(QKVMapping(mc + "self_attention.linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv")))
    if dims.qk_norm:
        table.append(Mapping(mc + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)))
        table.append(Mapping(mc + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",)))
    return table


def _global_table(dims: ModelDims, value_head: bool) -> list[Mapping]:
    table = [
        VocabMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Mapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if value_head:
        table.append(Mapping("output_layer.weight", ("score.weight",)))
    elif not dims.tie_word_embeddings:
        table.append(VocabMapping("output_layer.weight", ("lm_head.weight",)))
    return table


class WeightMap:
    """All mappings of one model: lookup by megatron name (local spec or TE spec, any layer)."""

    def __init__(self, dims: ModelDims, value_head: bool = False):
        self.dims = dims
        self.value_head = value_head
        self._layer = {m.mcore[len("decoder.layers.{layer}.") :]: m for m in _layer_table(dims)}
        self._global = {m.mcore: m for m in _global_table(dims, value_head)}

    def lookup(self, mcore_name: str, layer_offset: int = 0, expert_offset: int = 0) -> Mapping:
        """Mapping of a chunk-local megatron name; the offsets turn local layer / expert numbers global."""
        name = canonical_name(mcore_name)
        if self.is_tied_copy(name):
            return VocabMapping(name, ("model.embed_tokens.weight",))
        if name in self._global:
            return self._global[name]
        match = _LAYER_RE.match(name)
        if match:
            layer, rest = int(match.group(1)) + layer_offset, match.group(2)
            expert = _EXPERT_RE.match(rest)
            if expert:
                rest = f"mlp.experts.local_experts.{EXPERT}.{expert.group(2)}"
            if rest in self._layer:
                return self._layer[rest].with_layer(layer, int(expert.group(1)) + expert_offset if expert else None)
        raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r} ({self.dims.model_type})")

    def is_tied_copy(self, mcore_name: str) -> bool:
        """The last pipeline stage's copy of tied embeddings: loaded from, but never exported to, HF."""
        tied = self.dims.tie_word_embeddings and not self.value_head
        return tied and canonical_name(mcore_name) == "output_layer.weight"

    def all_mappings(self) -> list[Mapping]:
        """Every mapping of the full model, with global layer numbers, in HF order."""
        experts = range(self.dims.num_experts)
        layers = [
            m.with_layer(i, e)
            for i in range(self.dims.num_layers)
            for m in self._layer.values()
            for e in (experts if m.expert else [None])
        ]
        return (
            [self._global["embedding.word_embeddings.weight"]]
            + layers
            + [m for k, m in self._global.items() if k != "embedding.word_embeddings.weight"]
        )

    def local_experts(self, ep: int) -> int:
        """Experts each of `ep` expert-parallel ranks holds (0 for dense models)."""
        return self.dims.num_experts // ep

    def hf_names(self) -> list[str]:
        return [n for m in self.all_mappings() for n in m.hf]


def canonical_name(name: str) -> str:
    """Strip DDP/Float16 wrappers (`module.`) and map TE fused-norm names to local-spec names."""
    while name.startswith("module."):
        name = name[len("module.") :]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in TE_NAME_ALIASES:
        return f"decoder.layers.{match.group(1)}.{TE_NAME_ALIASES[match.group(2)]}"
    return name
