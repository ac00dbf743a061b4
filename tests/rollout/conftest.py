"""Tiny HF checkpoints for the rollout tests: each actor model has a same-config twin with other weights."""
import pytest

from megarl.testing.models import save_tiny_hf_model


@pytest.fixture(scope="session")
def rollout_models(tmp_path_factory):
    """{name: path}: 4-layer llama / qwen2 / qwen3 actors and `*_other` twins (different seed, same config)."""
    root = tmp_path_factory.mktemp("rollout_hf")
    paths = {}
    for seed, arch in enumerate(("llama", "qwen2", "qwen3")):
        for suffix, offset in (("", 0), ("_other", 100)):
            paths[arch + suffix] = root / (arch + suffix)
            save_tiny_hf_model(arch, paths[arch + suffix], seed=seed + offset, num_layers=4)
    return paths
