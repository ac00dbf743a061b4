"""A tiny policy (Qwen2, 2 layers, hidden 64, 2 heads of 32: vLLM's CPU attention needs head_dim 32)
with the character tokenizer, raw arithmetic prompts, and a runner for `megarl train` subprocesses."""

import pytest


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """{"model": dir, "train": parquet, "test": parquet}."""
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_policy

    root = tmp_path_factory.mktemp("trainer_task")
    tok = build_tiny_tokenizer()
    save_tiny_policy(root / "model", tok)
    paths = write_task_splits("arithmetic", 200, str(root / "data"), chat=False)
    return {"model": str(root / "model"), **paths}
