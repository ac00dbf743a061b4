"""Tiny HF checkpoints for the rollout tests: each actor model has same-config twins with other weights.

Hidden 128 with 4 heads (head_dim 32: vLLM's CPU attention has no kernel for head_dim 16) and
initializer_range 0.2, so greedy continuations vary instead of repeating one token.
"""

import pytest

from megarl.testing.models import save_tiny_hf_model

SIZES = dict(num_layers=4, hidden_size=128, intermediate_size=256, initializer_range=0.2)


@pytest.fixture(scope="session")
def rollout_models(tmp_path_factory):
    """{name: path}: 4-layer llama / qwen2 / qwen3 actors, `*_other` and `*_third` twins (other seeds)."""
    root = tmp_path_factory.mktemp("rollout_hf")
    paths = {}
    for seed, arch in enumerate(("llama", "qwen2", "qwen3")):
        for suffix, offset in (("", 0), ("_other", 100), ("_third", 200)):
            paths[arch + suffix] = root / (arch + suffix)
            save_tiny_hf_model(arch, paths[arch + suffix], seed=seed + offset, **SIZES)
    return paths
