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
