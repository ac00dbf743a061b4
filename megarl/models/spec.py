"""Layer specs and megatron-core model construction from `ModelDims` + `ParallelLayout`.

Owns: `transformer_config`, `layer_spec` (Transformer Engine spec when TE imports, the local
pure-torch spec otherwise), `build_model_chunks` (one GPTModel per virtual pipeline stage, with
the critic / reward-model scalar head), and RoPE variants megatron-core does not compute itself.

MoE (`dims.moe`): every layer's MLP is megatron-core's `MoELayer` with `SequentialMLP` experts
(`moe_grouped_gemm=False`, on the local and the TE spec alike, so parameter names are the same
everywhere), dropless (no capacity factor, like HF), with the router normalisation HF uses (see
`hf_config`). Token dispatcher: see `MOE_TOKEN_DISPATCHER`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.models.hf_config import ModelDims
from megarl.models.layout import ParallelLayout
from megarl.models.mapping import padded_vocab_size


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    """True when Transformer Engine imports (GPU builds / the NGC image)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises OSError/ImportError/RuntimeError without CUDA libraries
        return False
    return torch.cuda.is_available()


MOE_TOKEN_DISPATCHER = "alltoall"
"""megatron-core's all-to-all token dispatcher: its choice for EP > 1, and the only one that allows
`variable_seq_lengths` (the training engine's unpadded micro-batches). On CPU it needs
`megatron_patches.moe_dispatch` (split sizes as host arrays for gloo's all_to_all_single)."""


def moe_config_kwargs(dims: ModelDims) -> dict:
    """The `TransformerConfig` fields of a MoE model (empty for dense models)."""
    moe = dims.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,  # softmax → top-k (unnormalised) vs top-k → softmax
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coef else "none",
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_input_jitter_eps=moe.jitter_eps or None,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
    )


def transformer_config(dims: ModelDims, layout: ParallelLayout, dtype: torch.dtype = torch.float32, **overrides):
    """The megatron-core `TransformerConfig` of a model at a layout (overrides win)."""
    from megatron.core.transformer import TransformerConfig

    use_te = te_available()
    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        # TE's ring exchange of K/V chunks (overlaps with attention). "a2a+p2p" would need megatron's
        # global hierarchical CP groups, which per-role process groups do not create.
        cp_comm_type="p2p" if layout.cp > 1 else None,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=use_te and layout.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=use_te,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # also for dense models: megatron-core refuses its default (allgather) with variable_seq_lengths
        moe_token_dispatcher_type=MOE_TOKEN_DISPATCHER,
    )
    if "cuda_graph_modules" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        # megatron-core 0.19's default, "full", warns at every build that it is deprecated for [] (the same: the
        # whole layer; megarl captures no CUDA graphs)
        kwargs["cuda_graph_modules"] = []
    kwargs.update(moe_config_kwargs(dims))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(dims: ModelDims):
    """Transformer Engine layer spec when TE imports, megatron-core's local spec otherwise (its core
    attention computed by torch's fused kernel: `megarl.models.attention.SdpaAttention`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = dict(num_experts=dims.num_experts, moe_grouped_gemm=False) if dims.moe else {}
    if te_available():
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=dims.qk_norm, **moe)
    from megarl.models.attention import SdpaAttention

    spec = specs.get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm", **moe)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention  # torch's fused kernel
    return spec


class ValueHead(torch.nn.Module):
    """Scalar head for critic / reward model: hidden [s, b, h] → values [s, b, 1] (replicated over TP).

    Under sequence parallelism each TP rank holds s/tp of the hidden states: they are gathered over
    `tp_group` (the role's; None: megatron's global one, which only the SPMD tools initialise), and the
    backward hands each rank its own slice of the gradient. Not summed over TP: every rank computes the
    same values and loss from the whole sequence, so a sum (megatron's default reduce-scatter, meant for
    vocab-parallel heads) would make the backbone's gradient tp times too large.
    """

    def __init__(self, config, tp_group=None):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, std=config.init_method_std)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return F.linear(hidden_states, self.weight), None


def hf_rope_inv_freq(hf_config) -> Optional[torch.Tensor]:
    """Inverse RoPE frequencies for scaled variants (llama3, linear) computed by `transformers` itself."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "default":
        return None
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    if scaling != 1.0:
        raise ValueError(f"rope_type={rope_type!r} with attention scaling {scaling} is not supported")
    return inv_freq


def build_model_chunks(
    dims: ModelDims,
    config,
    *,
    pp_rank: int,
    hf_config=None,
    value_head: bool = False,
    pg_collection=None,
    vocab_divisible_by: int = 128,
) -> list[torch.nn.Module]:
    """One GPTModel per virtual stage of pipeline rank `pp_rank` (a list of length vpp), on the current CUDA
    device where there is one."""
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size or 1
    pp = config.pipeline_model_parallel_size
    inv_freq = hf_rope_inv_freq(hf_config) if hf_config is not None else None
    chunks = []
    for vp_stage in range(vpp):
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(dims),
            vocab_size=padded_vocab_size(dims.vocab_size, config.tensor_model_parallel_size, vocab_divisible_by),
            max_sequence_length=dims.max_position_embeddings,
            pre_process=pp_rank == 0 and vp_stage == 0,
            post_process=pp_rank == pp - 1 and vp_stage == vpp - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=dims.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=dims.rope_theta,
            pg_collection=pg_collection,
            vp_stage=vp_stage if vpp > 1 else None,
        )
        if inv_freq is not None:
            model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq)
        if value_head and model.post_process:
            model.output_layer = ValueHead(config, pg_collection.tp if pg_collection is not None else None)
        _norms_in_params_dtype(model, config.params_dtype)
        if torch.cuda.is_available():  # as Megatron-LM's get_model: modules megatron does not place itself
            model.cuda(torch.cuda.current_device())  # (torch norms of the local spec, the value head) too
        chunks.append(model)
    return chunks


def _norms_in_params_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The local spec's norms (`WrappedTorchNorm`: torch's RMSNorm / LayerNorm) are created in float32
    whatever `params_dtype` is. In a bf16 model torch then cannot use its fused norm ("Mismatch dtype
    between input and weight ... Cannot dispatch to fused implementation") and falls back to the composite
    one. Megatron-LM casts the whole model (`Float16Module`); only the norms are cast here, so buffers kept
    in float32 on purpose (MoE router state) stay so. TE's norms take `params_dtype` themselves."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)


def layer_offset(config, pp_rank: int, vp_stage: Optional[int]) -> int:
    """Global index of a chunk's first layer (megatron's own rule, so uneven layouts agree)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
