"""A tiny chat policy for the agent tests: Qwen2, 2 layers, hidden 64, 2 heads of 32, the character
tokenizer (its ChatML template renders tools), 4096 positions (a prompt with tools is ~700 tokens),
served by the embedded engine; plus helpers shared by the agent test files."""

import pytest
import torch


@pytest.fixture(scope="session")
def tok():
    from megarl.data.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def model_path(tmp_path_factory, tok):
    from megarl.testing.models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("agent_model") / "qwen2"
    save_tiny_hf_model(
        "qwen2",
        path,
        vocab_size=len(tok),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tokenizer=tok,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return str(path)


@pytest.fixture(scope="session")
def engine(model_path):
    from megarl.rollout import create_engine

    return create_engine(model_path, backend="embedded")


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
