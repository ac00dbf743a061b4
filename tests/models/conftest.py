"""Tiny HF checkpoints shared by the model-bridge tests (built once per session, no download)."""

import pytest

from megarl.testing.models import ARCHS, MOE_ARCHS, save_tiny_hf_model

LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{name: path} for the dense and MoE families (2 layers, hidden 64), Llama-3 RoPE, 4-layer models for VPP."""
    root = tmp_path_factory.mktemp("tiny_hf")
    paths = {}
    for seed, arch in enumerate(ARCHS):
        paths[arch] = root / arch
        save_tiny_hf_model(arch, paths[arch], seed=seed)
    paths["llama3_rope"] = root / "llama3_rope"
    save_tiny_hf_model("llama", paths["llama3_rope"], seed=7, rope_scaling=LLAMA3_ROPE)
    for seed, arch in enumerate(MOE_ARCHS, start=20):
        paths[arch] = root / arch
        save_tiny_hf_model(arch, paths[arch], seed=seed)
    for arch in ("qwen2", "qwen3"):
        paths[f"{arch}_4layers"] = root / f"{arch}_4layers"
        save_tiny_hf_model(arch, paths[f"{arch}_4layers"], seed=11, num_layers=4)
    return paths
