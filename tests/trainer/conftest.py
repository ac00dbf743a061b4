"""A tiny policy (Qwen2, 2 layers, hidden 64, 2 heads of 32: vLLM's CPU attention needs head_dim 32)
with the character tokenizer, raw arithmetic prompts, and a runner for `megarl train` subprocesses."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """{"model": dir, "train": parquet, "test": parquet}."""
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_hf_model

    root = tmp_path_factory.mktemp("trainer_task")
    tok = build_tiny_tokenizer()
    save_tiny_hf_model("qwen2", root / "model", vocab_size=len(tok), hidden_size=64, num_heads=2, num_kv_heads=2,
                       tokenizer=tok, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    paths = write_task_splits("arithmetic", 200, str(root / "data"), chat=False)
    return {"model": str(root / "model"), **paths}


def overrides(task: dict, run_dir, *extra: str) -> list[str]:
    """A few-step CPU run of the quickstart configs on the tiny task (TP2 actor, 2 worker processes)."""
    return [f"model.hf_path={task['model']}", f"data.files=[{task['train']}]", f"validation.files=[{task['test']}]",
            "data.apply_chat_template=false", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "validation.max_prompts=8", "trainer.progress_bar=false", f"trainer.run_dir={run_dir}",
            "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0", *extra]


def train_command(config: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", "--config", str(REPO / "configs" / config), *args]


def run_train(config: str, args: list[str], timeout: float = 480, env: dict | None = None):
    """Run `megarl train` to completion; (returncode, output, seconds)."""
    start = time.perf_counter()
    proc = subprocess.run(train_command(config, args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
