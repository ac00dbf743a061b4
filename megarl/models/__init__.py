"""Models: HF config → megatron-core GPTModel (actor, reference, critic, reward), weight tables, conversion.

Modules: `hf_config` (supported families), `layout` (parallel layouts), `mapping` (HF ↔ megatron
name tables and split/merge rules), `spec` (TransformerConfig, layer spec, model chunks),
`bridge` (build + load/export weights), `convert` (checkpoint conversion), `parity` (logit
checks). `hf_config`, `layout` and `mapping` import without megatron; the rest import it lazily.
"""
