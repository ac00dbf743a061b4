"""Critic / reward-model variant: the same backbone with a scalar head (`score.weight` in HF)."""

import pytest
import torch

from megarl.models.layout import ParallelLayout
from megarl.testing.dist import run_distributed
from megarl.testing.models import tiny_hf_config


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("rm") / "llama_rm"
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(tiny_hf_config("llama", num_labels=1, pad_token_id=0))
    model.save_pretrained(path)
    return path


def values_rank(hf_path: str, tp: int, tokens: torch.Tensor):
    """Per-rank: build the value-head model at TP=tp, load HF weights, return per-token values [b, s]."""
    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron, ranks

    layout = ParallelLayout(tp=tp)
    init_megatron(layout)
    bridge = ModelBridge.from_hf_path(hf_path, layout, value_head=True)
    tp_rank, pp_rank, _ = ranks()
    (model,) = bridge.build(pp_rank)
    bridge.load_hf_weights([model], hf_path, tp_rank=tp_rank, pp_rank=pp_rank)
    with torch.no_grad():
        values = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
    return values.squeeze(-1)


def test_reward_model_values_match_transformers_score_head_at_tp1_and_tp2(reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    tokens = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    with torch.no_grad():
        expected = hf.score(hf.model(tokens).last_hidden_state).squeeze(-1)
    tp1 = run_distributed(values_rank, 1, str(reward_model_dir), 1, tokens)[0]
    tp2 = run_distributed(values_rank, 2, str(reward_model_dir), 2, tokens)
    assert tp1.shape == (2, 12)
    torch.testing.assert_close(tp1, expected, atol=1e-5, rtol=0)
    for values in tp2:  # the head is replicated: every TP rank holds the same values
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)


def test_critic_from_a_causal_lm_checkpoint_starts_with_a_fresh_head(tiny_models):
    values = run_distributed(values_rank, 1, str(tiny_models["qwen2"]), 1, torch.ones(1, 5, dtype=torch.long))[0]
    assert values.shape == (1, 5) and torch.isfinite(values).all()


def sequence_parallel_head_rank(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor):
    """Per rank: the head under sequence parallelism on this rank's half of the sequence, with the role's
    TP group passed explicitly (megatron's global groups are never initialised in megarl's engines)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megarl.models.spec import ValueHead

    tp_group = dist.new_group([0, 1])
    config = SimpleNamespace(
        sequence_parallel=True, hidden_size=hidden.shape[-1], params_dtype=torch.float32, init_method_std=0.02
    )
    head = ValueHead(config, tp_group)
    with torch.no_grad():
        head.weight.copy_(weight)
    rank, half = dist.get_rank(), hidden.shape[0] // 2
    mine = hidden[rank * half : (rank + 1) * half].clone().requires_grad_()
    values, _ = head(mine)
    ((values.squeeze(-1) - target) ** 2).mean().backward()  # each rank: the loss of the whole sequence
    return values.detach(), mine.grad, head.weight.grad


def test_a_sequence_parallel_value_head_gathers_over_its_group_and_does_not_sum_gradients_over_tp():
    """Every TP rank computes the same values and loss from the gathered sequence: the backbone's
    gradient is that loss's gradient, sliced per rank (a sum over TP, megatron's default for the
    vocab-parallel output layer, would double it at TP2)."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight, target = torch.randn(6, 2, 8, generator=gen), torch.randn(1, 8, generator=gen), torch.randn(6, 2)
    ref_hidden, ref_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = torch.nn.functional.linear(ref_hidden, ref_weight)
    ((expected.squeeze(-1) - target) ** 2).mean().backward()
    results = run_distributed(sequence_parallel_head_rank, 2, hidden, weight, target)
    for rank, (values, hidden_grad, weight_grad) in enumerate(results):
        torch.testing.assert_close(values, expected.detach())
        torch.testing.assert_close(hidden_grad, ref_hidden.grad[rank * 3 : (rank + 1) * 3])
        torch.testing.assert_close(weight_grad, ref_weight.grad)  # the same on every rank: no TP reduction
