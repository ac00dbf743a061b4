"""Predicted device memory of one GPU of a Megatron role, of a vLLM engine, and of the weight sync.

Owns: `Shard` (how a role's parameters are split: TP/PP/CP/EP, expert TP, DP and expert DP),
`role_memory` (weights, gradients, optimizer state, activations, log-prob buffers, as
`megarl.engine` builds them), `vllm_memory` (weights, KV cache and how many sequences it holds) and
`sync_buffer_bytes`. Every number is bytes on the most loaded GPU (the largest pipeline stage).

What the engine does, and so what is counted (megarl.engine.engine / logprobs / rollout.sharding):
* parameters in the role's dtype; megatron pads the vocabulary to a multiple of 128·TP;
* DDP with `grad_reduce_in_fp32=True`: an fp32 gradient buffer the size of the parameters;
* the distributed optimizer (Adam) sharded over DP·CP (experts: over expert DP): fp32 main
  parameters (bf16 training only) + two fp32 moments — 12 bytes per parameter in bf16, 8 in fp32;
* activations of a micro-batch of `micro_batch_tokens` (CP splits the tokens, sequence parallelism
  (TP > 1 on GPU) splits the hidden-sized ones over TP); with `recompute` only each layer's input is
  kept, plus one layer's working set; the first pipeline stage holds min(pp, micro-batches) in flight;
* the vocab-parallel log-prob: bf16 logits [tokens × V/tp] (+ their gradient when training) and
  float32 chunks of `logprob_chunk_tokens` rows (two in the forward, three in the backward);
* the weight sync: (1 + prefetch) gathered buckets + one output bucket on a rollout rank, two
  packed shares on a sender (rollout/sharding/transport.py), bucket = rollout.sync_bucket_mb.
Pure Python (imports megarl.models for ModelDims and the vocabulary padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.hf_config import ModelDims
from megarl.models.mapping import padded_vocab_size

CONTEXT_BYTES = int(1.5 * 2**30)
"""CUDA context, NCCL communicators and allocator slack of one GPU process (measured ~1-2 GiB on H100)."""
VLLM_NON_TORCH_BYTES = 2**30
"""vLLM's own CUDA context, CUDA graphs and NCCL buffers, outside its torch allocations."""
VLLM_BATCHED_TOKENS = 8192
"""vLLM's profiling forward pass (max_num_batched_tokens) whose activations it reserves."""
VLLM_MAX_SEQS = 256
"""vLLM's max_num_seqs: the sampler's float32 logits are [seqs × vocab]."""


@dataclass(frozen=True)
class Shard:
    """How one role's model is split over its GPUs."""

    tp: int = 1
    """Tensor-parallel size (attention heads, MLP columns, vocabulary split)."""
    pp: int = 1
    """Pipeline stages (the largest stage holds ceil(layers / pp) layers)."""
    vpp: int = 1
    """Virtual stages per pipeline rank."""
    cp: int = 1
    """Context-parallel size (each rank holds tokens / cp of a micro-batch)."""
    ep: int = 1
    """Expert-parallel size (routed experts split ep ways)."""
    etp: int = 1
    """Expert tensor-parallel size (megarl: = tp; Megatron-LM also allows 1)."""
    dp: int = 1
    """Data-parallel size of the dense parameters (the optimizer is sharded over dp * cp)."""
    edp: int = 1
    """Expert data-parallel size (etp·ep·edp = tp·cp·dp)."""

    @classmethod
    def of(cls, layout, world: int) -> "Shard":
        """megarl's shard of a `ParallelLayout` over `world` GPUs (expert TP = TP, as megarl.engine.parallel)."""
        dp = world // layout.model_parallel_size
        return cls(
            tp=layout.tp,
            pp=layout.pp,
            vpp=layout.vpp,
            cp=layout.cp,
            ep=layout.ep,
            etp=layout.tp,
            dp=dp,
            edp=max(1, dp * layout.cp // layout.ep),
        )


@dataclass(frozen=True)
class RoleMemory:
    """Bytes on one GPU of a role: persistent state and the peak working set of its heaviest call."""

    weights: int
    """Parameters in the role's dtype."""
    grads: int
    """fp32 gradient buffer (trainable roles)."""
    optimizer: int
    """This rank's shard of the distributed optimizer's state (trainable roles)."""
    activations: int
    """Peak activations of the role's heaviest call (update for trainable roles, else forward)."""
    logits: int
    """Log-prob / value-head buffers at that peak (logits, their gradient, float32 chunks)."""

    @property
    def static(self) -> int:
        """What stays on the GPU between calls unless the role is offloaded."""
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.static + self.activations + self.logits


# ----------------------------------------------------------------------------- parameter counts


def layer_params(dims: ModelDims) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one transformer layer."""
    h, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    dense = (
        h * (q + 2 * kv)
        + q * h
        + 2 * h
        + (q + 2 * kv if dims.qkv_bias else 0)
        + (2 * dims.head_dim if dims.qk_norm else 0)
    )
    if dims.moe is None:
        return dense + 3 * h * dims.ffn_hidden_size, 0
    moe = dims.moe
    dense += h * moe.num_experts + 3 * h * moe.shared_expert_ffn_hidden_size + (h if moe.shared_expert_gate else 0)
    return dense, moe.num_experts * 3 * h * moe.ffn_hidden_size


def total_params(dims: ModelDims) -> int:
    """Parameters of the HF model (vocabulary unpadded)."""
    dense, expert = layer_params(dims)
    embed = dims.vocab_size * dims.hidden_size
    return dims.num_layers * (dense + expert) + embed * (1 if dims.tie_word_embeddings else 2) + dims.hidden_size


def active_params(dims: ModelDims) -> int:
    """Parameters a token passes through (top-k experts only); the FLOPs of a token are ~2x this."""
    dense, expert = layer_params(dims)
    routed = expert * dims.moe.topk // dims.moe.num_experts if dims.moe else 0
    return dims.num_layers * (dense + routed) + 2 * dims.vocab_size * dims.hidden_size


def local_params(dims: ModelDims, shard: Shard, value_head: bool = False) -> tuple[int, int]:
    """(non-expert, expert) parameters held by one GPU of the largest pipeline stage."""
    dense, expert = layer_params(dims)
    layers = math.ceil(dims.num_layers / shard.pp)
    embed = padded_vocab_size(dims.vocab_size, shard.tp) * dims.hidden_size // shard.tp
    output = dims.hidden_size if value_head else embed
    if shard.pp == 1:
        ends = embed + (0 if dims.tie_word_embeddings and not value_head else output)
    else:
        ends = max(embed, output)
    return layers * dense // shard.tp + ends + dims.hidden_size, layers * expert // (shard.etp * shard.ep)


# ----------------------------------------------------------------------------- activations


def _layer_bytes_per_token(dims: ModelDims, shard: Shard, sp: bool) -> int:
    """bf16 activations one layer saves for the backward, per token on this rank (Korthikanti et al.,
    flash attention: no s² term; SwiGLU MLP; MoE: top-k expert widths plus the permuted tokens)."""
    h, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    hidden = 4 * h / (shard.tp if sp else 1)  # norm inputs, qkv input, fc1 input
    attention = (2 * q + 2 * kv) / shard.tp  # q, k, v after rotary; attention output
    if dims.moe:
        width = (
            dims.moe.topk * dims.moe.ffn_hidden_size
        ) / shard.etp + dims.moe.shared_expert_ffn_hidden_size / shard.tp
        mlp = 3 * width + 2 * dims.moe.topk * h
    else:
        mlp = 3 * dims.ffn_hidden_size / shard.tp  # fc1 output (gate, up), SwiGLU output
    return int(2 * (hidden + attention + mlp))


def logprob_bytes(tokens: int, vocab_shard: int, chunk: int, *, backward: bool, logit_bytes: int = 2) -> int:
    """Buffers of `megarl.engine.logprobs.vocab_parallel_logprobs` over [tokens × vocab_shard] logits:
    the logits (and, training, their gradient) plus its float32 chunks (2 alive in the forward, 3 in the
    backward: the previous chunk's input and gradient while the next one is copied) and three
    float32 per-token outputs."""
    chunk_rows = min(chunk, tokens)
    logits = tokens * vocab_shard * logit_bytes * (2 if backward else 1)
    return logits + (3 if backward else 2) * chunk_rows * vocab_shard * 4 + 3 * 4 * tokens


def micro_batch_tokens(role_cfg, max_seq_len: int) -> int:
    """Tokens of the largest micro-batch: the budget, or one whole row when a row is longer."""
    return max(role_cfg.micro_batch_tokens, max_seq_len)


def role_memory(
    dims: ModelDims,
    shard: Shard,
    *,
    dtype_bytes: int = 2,
    trainable: bool,
    recompute: bool,
    tokens: int,
    micro_batches: int = 1,
    chunk: int = 1024,
    sp: bool = True,
    value_head: bool = False,
) -> RoleMemory:
    """Memory of one GPU of a role: see the module docstring for what is counted."""
    dense, expert = local_params(dims, shard, value_head)
    params = dense + expert
    opt_bytes = 12 if dtype_bytes == 2 else 8
    sp = sp and shard.tp > 1
    rank_tokens = math.ceil(tokens / shard.cp)
    per_layer = _layer_bytes_per_token(dims, shard, sp)
    layers = math.ceil(dims.num_layers / shard.pp)
    vocab_shard = 1 if value_head else padded_vocab_size(dims.vocab_size, shard.tp) // shard.tp
    if trainable:
        saved = (2 * dims.hidden_size // (shard.tp if sp else 1)) if recompute else per_layer
        in_flight = min(shard.pp, micro_batches) if shard.pp > 1 else 1
        activations = in_flight * rank_tokens * layers * saved + (rank_tokens * per_layer if recompute else 0)
    else:
        activations = 2 * rank_tokens * per_layer  # one layer's working set and the residual stream
    return RoleMemory(
        weights=params * dtype_bytes,
        grads=params * 4 if trainable else 0,
        optimizer=(dense * opt_bytes // (shard.dp * shard.cp) + expert * opt_bytes // shard.edp) if trainable else 0,
        activations=int(activations),
        logits=logprob_bytes(rank_tokens, vocab_shard, chunk, backward=trainable),
    )


# ----------------------------------------------------------------------------- vLLM and the weight sync


@dataclass(frozen=True)
class VLLMMemory:
    """One GPU of a vLLM engine of TP `tp`."""

    budget: int
    """gpu_memory_utilization × HBM: what the engine takes (it needs this much free at start)."""
    weights: int
    overhead: int
    """Profiling activations, sampler logits, CUDA graphs, context."""
    kv_cache: int
    """budget − weights − overhead (negative: the engine cannot start)."""
    kv_bytes_per_token: int
    sequences: int
    """Full-length (max_model_len) sequences the KV cache holds at once."""


def kv_bytes_per_token(dims: ModelDims, tp: int, dtype_bytes: int = 2) -> int:
    """K and V of every layer on one rank (KV heads are split over TP, or replicated when TP > KV heads)."""
    kv_heads = max(1, dims.num_kv_heads // tp)
    return 2 * dims.num_layers * kv_heads * dims.head_dim * dtype_bytes


def vllm_memory(
    dims: ModelDims, tp: int, hbm_bytes: int, utilization: float, max_model_len: int, dtype_bytes: int = 2
) -> VLLMMemory:
    """vLLM's memory split on one GPU: weights, reserved activations, and the KV cache left over."""
    h, vocab = dims.hidden_size, padded_vocab_size(dims.vocab_size, tp)
    budget = int(utilization * hbm_bytes)
    weights = total_params(dims) * dtype_bytes // tp
    shard = Shard(tp=tp, etp=tp)
    activations = VLLM_BATCHED_TOKENS * (_layer_bytes_per_token(dims, shard, sp=False) + 4 * h)
    overhead = activations + VLLM_MAX_SEQS * vocab // tp * 4 * 2 + VLLM_NON_TORCH_BYTES
    kv = budget - weights - overhead
    per_token = kv_bytes_per_token(dims, tp, dtype_bytes)
    return VLLMMemory(
        budget=budget,
        weights=weights,
        overhead=overhead,
        kv_cache=kv,
        kv_bytes_per_token=per_token,
        sequences=max(0, kv) // (per_token * max_model_len),
    )


def sync_buffer_bytes(bucket_bytes: int, tp: int, *, receiver: bool, sender: bool, prefetch: int = 1) -> int:
    """Extra memory of the weight sync on one GPU (rollout rank and/or training sender)."""
    received = (1 + prefetch) * bucket_bytes + bucket_bytes if receiver else 0
    return received + (2 * bucket_bytes // tp if sender else 0)
