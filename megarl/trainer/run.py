"""`train(cfg)`: check everything cheap first, then start Ray, the workers and the loop.

Order matters for users: the config is validated (sizes, layouts, names, files), the prompt
data is loaded and tokenised (malformed rows, prompts over the limit) and the pre-flight checks
run (`megarl.trainer.preflight`: run_dir writable, weights readable, GPUs present, the resume
target intact, every data_source rewarded) *before* `ray.init` and before config.yaml is written,
so a bad run fails in seconds naming the field, and nothing already in the run directory is touched.

Stopping: the first Ctrl-C / SIGTERM (`megarl.utils.interrupts`) says which checkpoint a rerun
continues from and stops the workers and Ray; worker processes die with their raylet, children
included (`megarl.utils.lifetime`, installed as Ray's worker setup hook).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.data.batch import Batch
from megarl.trainer.preflight import preflight
from megarl.trainer.state import remove_leftovers
from megarl.utils.lifetime import RAY_SETUP_HOOK, NodeLostError


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
    from megarl.data.datasets import PromptDataset, PromptLoader, collate_prompts
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards import RewardRunner

    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.hf_path)
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


def train(cfg, derived, forks=None) -> list[dict]:
    """Run the configured training; returns the metrics of the steps run by this call.

    forks: the run's `megarl.controller.fork_server.ForkServer`, if the caller started it (`megarl train` does,
    before its config checks); None: started here where `fork_server.wanted(cfg)`. Stopped here either way."""
    from megarl.controller import fork_server

    if forks is None and fork_server.wanted(cfg):
        forks = fork_server.start(cfg)  # first: it imports the workers' stack on a core the checks leave idle
    try:
        return _train(cfg, derived, forks)
    finally:
        if forks is not None:
            forks.stop()


def _train(cfg, derived, forks) -> list[dict]:
    from megarl.config import save_resolved
    from megarl.controller import init_ray
    from megarl.controller.cluster import Cluster
    from megarl.trainer.async_loop import AsyncRLTrainer
    from megarl.trainer.loop import RLTrainer

    data = load_run_data(cfg)
    plan = preflight(cfg, data)  # every local check passes before Ray starts or run_dir is written
    if _already_complete(cfg, plan):
        return []
    save_resolved(cfg, cfg.trainer.run_dir)
    remove_leftovers(cfg.trainer.run_dir)  # unpublished staging dirs and temp files of killed runs
    start, cluster, nodes, interrupted = time.perf_counter(), None, {}, False
    # a loaded machine can take over Ray's default 30 s to register the local raylet
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    try:
        init_ray(
            cfg,
            log_to_driver=os.environ.get("MEGARL_WORKER_LOGS", "0") == "1",  # worker logs: Ray session dir
            runtime_env={"worker_process_setup_hook": RAY_SETUP_HOOK}
            | ({"py_executable": forks.py_executable} if forks is not None else {}),
        )  # workers die with their raylet
        ray_s = time.perf_counter() - start
        cluster = Cluster(cfg, derived)
        phases = ", ".join(f"{name} {s:.1f}" for name, s in {"ray": ray_s, **cluster.startup}.items())
        print(f"[megarl] workers ready in {time.perf_counter() - start:.1f} s ({phases})", flush=True)
        nodes = _alive_nodes()
        _freeze_heap()
        trainer = RLTrainer if cfg.trainer.mode == "sync" else AsyncRLTrainer
        return trainer(cfg, derived, cluster, data).fit()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM (megarl.utils.interrupts): say what a rerun does, stop everything
        _report_interrupt(cfg.trainer.resume, cfg.trainer.run_dir)
        interrupted = True
        raise
    except Exception as err:
        lost = _lost_nodes(nodes, err) if cluster is not None else []
        if lost:
            raise NodeLostError(_node_lost_message(lost, err, cfg.trainer.resume, cfg.trainer.run_dir)) from err
        raise
    finally:
        _stop(cluster, data, ray_too=interrupted)


def _freeze_heap() -> None:
    """Keep what the start-up made (~340k objects: torch, transformers, Ray, the data) out of the driver's
    garbage collections from here on (`gc.freeze`). Each full collection walked them all: 140-170 ms, two or
    three times in the quickstart's 100 steps, every worker waiting meanwhile for the driver's next call."""
    import gc

    gc.freeze()


def _already_complete(cfg, plan) -> bool:
    """The run reached trainer.total_steps and wrote its HF export: say so instead of redoing the export."""
    from megarl.models.convert import MARKER

    tr = cfg.trainer
    exported = not tr.export_hf_at_end or (Path(tr.run_dir) / "hf" / MARKER).is_file()
    if tr.val_only or plan.step < tr.total_steps or not exported:
        return False
    print(
        f"[megarl] nothing to do: the run is complete at step {plan.step} = trainer.total_steps ({plan.directory});"
        " raise trainer.total_steps to train further",
        flush=True,
    )
    return True


def _alive_nodes() -> dict[str, tuple[str, int]]:
    """{node id: (address, raylet port)} of the Ray nodes alive now."""
    import ray

    return {
        n["NodeID"]: (n.get("NodeManagerAddress", "?"), int(n.get("NodeManagerPort", 0)))
        for n in ray.nodes()
        if n.get("Alive")
    }


def _lost_nodes(before: dict[str, tuple[str, int]], err: BaseException) -> list[tuple[str, str]]:
    """The nodes of `before` that are gone: (id, address). Ray's own health checks take seconds to mark a
    dead node, so a node also counts as lost when its raylet no longer accepts a connection."""
    import ray

    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 -- the head itself is gone: every node is lost to this run
        alive = set()
    return [
        (node, address) for node, (address, port) in before.items() if node not in alive or not _accepts(address, port)
    ]


def _accepts(address: str, port: int, timeout_s: float = 3.0) -> bool:
    import socket

    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _node_lost_message(lost: list[tuple[str, str]], err: BaseException, resume: str, run_dir: str) -> str:
    from megarl.trainer.state import plan_resume

    nodes = ", ".join(f"{address} (node {node[:12]})" for node, address in lost)
    cause = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    latest = plan_resume("auto", run_dir).directory if resume == "auto" else None
    rerun = (
        f"continues from the latest complete checkpoint, {latest}"
        if latest
        else "starts from the beginning (no checkpoint was completed)"
        if resume == "auto"
        else f"loads trainer.resume={resume} again"
    )
    return (
        f"lost Ray node {nodes} during the run ({type(err).__name__}: {cause}). Once the cluster has its nodes"
        f" back, rerunning the same command {rerun}"
    )


def _stop(cluster, data, ray_too: bool) -> None:
    """Stop the workers and the reward pool; after an interrupt also Ray itself (the local Ray
    processes, or this job's connection to a joined cluster) now, within the grace period, not at exit."""
    start = time.perf_counter()
    if cluster is not None:
        cluster.shutdown()
    data.rewards.close()
    if cluster is not None and not ray_too:
        print(f"[megarl] workers stopped in {time.perf_counter() - start:.1f} s", flush=True)
    if ray_too:
        from megarl.controller.placement import shutdown_ray

        shutdown_ray()
        print(
            f"[megarl] stopped: workers and Ray gone in {time.perf_counter() - start:.1f} s.",
            file=sys.stderr,
            flush=True,
        )


def _report_interrupt(resume: str, run_dir: str) -> None:
    """Ctrl-C / SIGINT: say what a rerun does before the workers are stopped (a second Ctrl-C exits at once)."""
    from megarl.trainer.state import plan_resume

    latest = plan_resume("auto", run_dir).directory
    if resume == "never":
        rerun = "starts over (trainer.resume=never); set trainer.resume=auto to continue"
    elif resume != "auto":
        rerun = f"loads {resume} again (trainer.resume); set trainer.resume=auto to continue from the latest"
    elif latest:
        rerun = f"continues from the latest complete checkpoint, {latest}"
    else:
        rerun = "starts from the beginning (no checkpoint was completed)"
    print(
        f"\n[megarl] interrupted: stopping the workers. Rerunning the same command {rerun}.",
        file=sys.stderr,
        flush=True,
    )
