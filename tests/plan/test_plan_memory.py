"""The memory model's parts move the way the engine's knobs move them (recompute, SP, CP, DP, EP,
precision, vocabulary padding), and vLLM's KV arithmetic; hardware table overrides."""

import pytest

from megarl.models.layout import ParallelLayout
from megarl.plan import gpu_spec
from megarl.plan.memory import (
    Shard,
    kv_bytes_per_token,
    local_params,
    logprob_bytes,
    role_memory,
    sync_buffer_bytes,
    total_params,
    vllm_memory,
)
from megarl.plan.presets import PRESETS

QWEN7B, LLAMA70B, MOE = PRESETS["qwen2.5-7b"], PRESETS["meta-llama-3-70b"], PRESETS["qwen3-30b-a3b"]


def _train(dims=QWEN7B, shard=Shard(), **kw):
    args = dict(trainable=True, recompute=False, tokens=16384)
    return role_memory(dims, shard, **{**args, **kw})


def test_parameter_counts_match_the_published_sizes():
    assert total_params(QWEN7B) == pytest.approx(7.62e9, rel=0.01)
    assert total_params(LLAMA70B) == pytest.approx(70.55e9, rel=0.01)
    assert total_params(MOE) == pytest.approx(30.5e9, rel=0.01)


def test_state_bytes_follow_precision_and_the_distributed_optimizer():
    one = _train()
    params = sum(local_params(QWEN7B, Shard()))
    assert (one.weights, one.grads, one.optimizer) == (2 * params, 4 * params, 12 * params)
    fp32 = _train(dtype_bytes=4)
    assert (fp32.weights, fp32.optimizer) == (4 * params, 8 * params)
    dp8 = _train(shard=Shard(dp=8))
    assert dp8.weights == one.weights and dp8.optimizer == pytest.approx(one.optimizer / 8, rel=1e-6)
    frozen = role_memory(QWEN7B, Shard(), trainable=False, recompute=False, tokens=16384)
    assert frozen.grads == frozen.optimizer == 0


def test_tensor_and_expert_parallelism_split_the_weights():
    assert _train(shard=Shard(tp=4, etp=4)).weights == pytest.approx(_train().weights / 4, rel=0.01)
    dense, experts = local_params(MOE, Shard())
    _, experts_ep8 = local_params(MOE, Shard.of(ParallelLayout(ep=8), 8))
    assert experts_ep8 == experts // 8 and experts > 10 * dense
    expert_dp = role_memory(MOE, Shard(ep=8, dp=8, edp=1), trainable=True, recompute=False, tokens=1)
    dense_dp = role_memory(MOE, Shard(ep=8, dp=8, edp=8), trainable=True, recompute=False, tokens=1)
    assert expert_dp.optimizer > 4 * dense_dp.optimizer  # experts are sharded over expert DP only


def test_recompute_sequence_and_context_parallelism_shrink_activations():
    full = _train(shard=Shard(tp=4, etp=4), sp=False)
    sp = _train(shard=Shard(tp=4, etp=4))
    recompute = _train(shard=Shard(tp=4, etp=4), recompute=True)
    cp2 = _train(shard=Shard(tp=4, etp=4, cp=2))
    assert recompute.activations < sp.activations < full.activations
    assert recompute.activations < full.activations / 5
    assert cp2.activations == pytest.approx(sp.activations / 2, rel=1e-3)
    assert cp2.logits < sp.logits


def test_pipeline_keeps_micro_batches_in_flight():
    one = _train(shard=Shard(pp=4), micro_batches=1)
    many = _train(shard=Shard(pp=4), micro_batches=16)
    assert many.activations == 4 * one.activations


def test_logprob_buffers_are_chunked():
    vocab = 152064
    forward = logprob_bytes(16384, vocab, 1024, backward=False)
    assert forward == 16384 * vocab * 2 + 2 * 1024 * vocab * 4 + 12 * 16384
    backward = logprob_bytes(16384, vocab, 1024, backward=True)
    assert backward - forward == 16384 * vocab * 2 + 1024 * vocab * 4  # the logits' gradient + one more chunk
    assert logprob_bytes(100, vocab, 1024, backward=False) == 100 * vocab * 2 + 2 * 100 * vocab * 4 + 1200


def test_vllm_kv_cache_and_sequences():
    h100 = gpu_spec("H100")
    v = vllm_memory(LLAMA70B, 8, h100.hbm_bytes, 0.5, 3072)
    assert kv_bytes_per_token(LLAMA70B, 8) == 2 * 80 * 1 * 128 * 2  # 8 KV heads over TP8: one per rank
    assert kv_bytes_per_token(LLAMA70B, 16) == kv_bytes_per_token(LLAMA70B, 8)  # replicated past the KV heads
    assert v.weights == total_params(LLAMA70B) * 2 // 8
    assert v.kv_cache == v.budget - v.weights - v.overhead
    assert v.sequences == v.kv_cache // (v.kv_bytes_per_token * 3072)
    assert vllm_memory(LLAMA70B, 1, h100.hbm_bytes, 0.9, 3072).kv_cache < 0  # 141 GB of weights on one GPU


def test_sync_buffers():
    bucket = 256 << 20
    assert sync_buffer_bytes(bucket, 4, receiver=True, sender=False) == 3 * bucket
    assert sync_buffer_bytes(bucket, 4, receiver=False, sender=True) == bucket // 2


def test_hardware_table_and_overrides():
    assert gpu_spec("b200").bf16_flops == 2250e12
    assert gpu_spec("A100", tflops=100, network_gbps=12.5).network_bandwidth == 12.5e9
    with pytest.raises(ValueError, match="must be > 0"):
        gpu_spec("H200", hbm_gb=0)
