"""Helpers of the trainer tests: run `megarl train` as a subprocess with test overrides.

Imported by name from the test modules (a plain module, not conftest: several test folders have
a conftest.py, and `from conftest import` picks whichever pytest imported first).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def overrides(task: dict, run_dir, *extra: str) -> list[str]:
    """A few-step CPU run of the quickstart configs on the tiny task (TP2 actor, 2 worker processes)."""
    return [
        f"model.hf_path={task['model']}",
        f"data.files=[{task['train']}]",
        f"validation.files=[{task['test']}]",
        "data.apply_chat_template=false",
        "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "validation.max_prompts=8",
        "trainer.progress_bar=false",
        f"trainer.run_dir={run_dir}",
        "actor.optim.lr=1e-3",
        "actor.optim.warmup_steps=0",
        *extra,
    ]


def train_command(config: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", "--config", str(REPO / "configs" / config), *args]


def run_train(config: str, args: list[str], timeout: float = 480, env: dict | None = None):
    """Run `megarl train` to completion; (returncode, output, seconds)."""
    start = time.perf_counter()
    proc = subprocess.run(
        train_command(config, args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
