"""`train(cfg)`: check everything cheap first, then start Ray, the workers and the loop.

Order matters for users: the config is validated (sizes, layouts, names, files) and the prompt
data is loaded and tokenised (malformed rows, prompts over the limit) *before* `ray.init`, so a
bad run fails in seconds naming the field, and nothing already in the run directory is touched.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from megarl.data.batch import Batch


@dataclass
class RunData:
    """The driver's data side: tokenizer, training loader, validation prompts, reward runner."""

    tokenizer: object
    loader: object
    validation: Optional[Batch]
    rewards: object
    agents: object = None
    """The agent loops' shared context (`megarl.agent.AgentContext`: tokenizer, limits, tools)."""

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)


def load_run_data(cfg) -> RunData:
    """Tokenizer, datasets (all row checks happen here) and the reward runner; no worker is started."""
    from transformers import AutoTokenizer

    from megarl.data.datasets import PromptDataset, PromptLoader, collate_prompts
    from megarl.rewards import RewardRunner

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    train = PromptDataset(cfg.data, tokenizer)
    loader = PromptLoader.from_config(train, cfg.data, cfg.trainer.prompts_per_step)
    validation = None
    if cfg.validation.files:
        val = PromptDataset(cfg.data, tokenizer, files=cfg.validation.files)
        count = min(len(val), cfg.validation.max_prompts or len(val))
        validation = collate_prompts([val[i] for i in range(count)], tokenizer.pad_token_id)
    agents = agent_context(cfg, tokenizer, [train] + ([val] if cfg.validation.files else []))
    return RunData(tokenizer, loader, validation, RewardRunner(cfg.reward), agents)


def agent_context(cfg, tokenizer, datasets):
    """The agent loops' context (tools loaded from rollout.agent.tool_config); every row's `agent_name`
    must name a registered loop (checked here, before any worker starts)."""
    import dataclasses

    from megarl.agent import AgentContext, get_agent_loop

    config = dataclasses.replace(cfg.rollout.agent, max_response_tokens=cfg.rollout.max_response_tokens)
    for name in sorted({row.get("agent_name") for ds in datasets for row in ds.rows} - {None, ""}):
        try:
            get_agent_loop(name)
        except (ValueError, TypeError) as err:
            raise ValueError(f"a data row's agent_name: {err}") from None
    return AgentContext(tokenizer, config=config)


def train(cfg, derived) -> list[dict]:
    """Run the configured training; returns the metrics of the steps run by this call."""
    from megarl.config import save_resolved
    from megarl.controller import init_ray
    from megarl.controller.cluster import Cluster
    from megarl.trainer.loop import RLTrainer

    data = load_run_data(cfg)
    save_resolved(cfg, cfg.trainer.run_dir)
    start = time.perf_counter()
    init_ray(cfg, log_to_driver=os.environ.get("MEGARL_WORKER_LOGS", "0") == "1")  # worker logs: Ray session dir
    cluster = Cluster(cfg, derived)
    print(f"[megarl] workers ready in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        return RLTrainer(cfg, derived, cluster, data).fit()
    except KeyboardInterrupt:
        _report_interrupt(cfg.trainer.resume, cfg.trainer.run_dir)
        raise
    finally:
        cluster.shutdown()
        data.rewards.close()


def _report_interrupt(resume: str, run_dir: str) -> None:
    """Ctrl-C / SIGINT: say what a rerun does before the workers are stopped (a second Ctrl-C exits at once)."""
    from megarl.trainer.state import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    if resume == "never":
        rerun = "starts over (trainer.resume=never); set trainer.resume=auto to continue"
    elif resume != "auto":
        rerun = f"loads {resume} again (trainer.resume); set trainer.resume=auto to continue from the latest"
    elif latest:
        rerun = f"continues from the latest complete checkpoint, {latest}"
    else:
        rerun = "starts from the beginning (no checkpoint was completed)"
    print(f"\n[megarl] interrupted: stopping the workers. Rerunning the same command {rerun}.",
          file=sys.stderr, flush=True)
