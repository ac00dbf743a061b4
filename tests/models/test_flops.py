"""Model FLOPs for MFU: 6·N·T for the weights plus causal attention, written out by hand."""

import torch

from megarl.models.flops import train_flops, weight_params
from megarl.models.hf_config import describe_hf_config
from megarl.testing.models import tiny_hf_config
from megarl.trainer.metrics import MFUMeter, PhaseTimer, timing_metrics


def test_train_flops_by_hand():
    dims = describe_hf_config(tiny_hf_config("llama"))  # h 64, 4 heads × 16, 2 kv heads, ffn 128, vocab 96, 2 layers
    per_layer = 64 * (2 * 64 + 2 * 32) + 3 * 64 * 128
    assert weight_params(dims) == 2 * per_layer + 96 * 64
    lengths = torch.tensor([3, 5])
    expected = 6 * weight_params(dims) * 8 + 6 * 2 * 64 * (9 + 25)
    assert train_flops(dims, lengths) == expected


def test_mfu_metric_is_flops_over_peak_time_and_gpus():
    dims = describe_hf_config(tiny_hf_config("llama"))
    batch = {"attention_mask": torch.ones(2, 4), "response_mask": torch.ones(2, 2)}
    timer = PhaseTimer()
    timer.seconds["actor_update"] = 2.0
    meter = MFUMeter(dims, gpus=4, peak_tflops=1e-6, epochs=2)  # 1 MFLOP/s per GPU
    out = timing_metrics(timer, batch, meter)
    expected = 2 * train_flops(dims, torch.tensor([4.0, 4.0])) / (2.0 * 4 * 1e6)
    assert abs(out["perf/mfu_actor_update"] - expected) < 1e-12
    assert "perf/mfu_actor_update" not in timing_metrics(timer, batch)


def test_moe_flops_count_the_active_experts():
    dims = describe_hf_config(
        tiny_hf_config("qwen2_moe")
    )  # attention as Llama's; 4 experts × 64, top-2, shared 96 + gate
    per_layer = 64 * (2 * 64 + 2 * 32) + 3 * 64 * (2 * 64 + 96) + 64 * (4 + 1)
    assert weight_params(dims) == 2 * per_layer + 96 * 64
