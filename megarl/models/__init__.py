"""Models: HF config → megatron-core GPTModel (actor, reference, critic, reward), weight tables, conversion.

Families: Llama (incl. Llama-3 RoPE), Mistral, Qwen2/2.5, Qwen3 (dense); Mixtral, Qwen3-MoE,
Qwen2-MoE (mixture of experts, with expert parallelism). `hf_config.supported_model_types()`.

Modules: `hf_config` (supported families), `layout` (parallel layouts), `mapping` (HF ↔ megatron
name tables and split/merge rules), `spec` (TransformerConfig, layer spec, model chunks),
`bridge` (build + load/export weights), `convert` (checkpoint conversion), `parity` (logit
checks). `hf_config`, `layout` and `mapping` import without megatron; the rest import it lazily.
"""
