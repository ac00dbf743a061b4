"""Kill points of the fault soak (`megarl.trainer.fault_soak`): one launched `megarl train` run, where a
kill landed, what a relaunch will find, and each kind of kill point — when it fires, the hold point it
freezes the run at, the damage done after it.

Owns `Launch` (the run in its own session, tagged with MEGARL_RUN_TAG so every process of it can be
found; `kill()` is SIGKILL of the driver's process group plus a check that nothing of the run is left),
`KINDS`, `reachable`, `hold_env`, `trigger`, `damage`, `progress` and the run's overrides
(`soak_overrides`: the quickstart config on the tiny arithmetic task, one CPU worker, the embedded
engine, `TOTAL_STEPS` steps, a checkpoint every step, `KEEP` kept, HF export). No Ray.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megarl.testing.processes import TAG_VAR, kill_tagged, wait_until_gone
from megarl.trainer import state
from megarl.trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
KINDS = (
    "startup",
    "anytime",
    "checkpoint",
    "driver_state",
    "prune",
    "metrics_rewrite",
    "export",
    "damaged_shard",
    "damaged_state",
    "unlisted_damage",
    "torn_metrics",
)
TOTAL_STEPS, KEEP = 4, 2


def soak_overrides(task: dict, run_dir: Path) -> list[str]:
    return [
        f"model.hf_path={task['model']}",
        f"data.files=[{task['train']}]",
        f"validation.files=[{task['test']}]",
        "data.apply_chat_template=false",
        "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "validation.max_prompts=4",
        "validation.every_steps=2",
        "trainer.progress_bar=false",
        f"trainer.run_dir={run_dir}",
        "actor.optim.lr=1e-3",
        "actor.optim.warmup_steps=0",
        "rollout.engine=embedded",
        "resources.gpus_per_node=1",
        "actor.layout.tp=1",
        f"trainer.total_steps={TOTAL_STEPS}",
        "trainer.checkpoint_every_steps=1",
        f"trainer.keep_checkpoints={KEEP}",
        "trainer.dump_rollouts_every_steps=0",
        "trainer.loggers=[console,jsonl]",
        "trainer.export_hf_at_end=true",
    ]


def make_task(root: Path) -> dict:
    """The tiny policy (Qwen2, 2 layers, hidden 64) with the character tokenizer and arithmetic prompts."""
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_policy

    tok = build_tiny_tokenizer()
    save_tiny_policy(root / "model", tok)
    return {"model": str(root / "model"), **write_task_splits("arithmetic", 200, str(root / "data"), chat=False)}


# ----------------------------------------------------------------------------- one launched run


class Launch:
    """`megarl train` in its own session (its process group is the driver's), tagged, logging to a file."""

    def __init__(self, task: dict, run_dir: Path, log: Path, env: Optional[dict] = None):
        self.run_dir, self.log, self.env = run_dir, log, dict(env or {})
        self.tag = f"soak-{os.getpid()}-{time.time_ns()}"
        command = [
            sys.executable,
            "-m",
            "megarl.cli",
            "train",
            "--config",
            str(REPO / "configs/grpo_quickstart.yaml"),
            *soak_overrides(task, run_dir),
        ]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, TAG_VAR: self.tag, **self.env},
            )
        self.start, self.wall_start = time.monotonic(), time.time()
        self.leftovers = set(engine_saving(run_dir)) | set(exporting(run_dir))  # of earlier kills

    def saving(self) -> list[Path]:
        """Engine checkpoints this launch is writing now (their staging directories)."""
        return [p for p in engine_saving(self.run_dir) if p not in self.leftovers]

    def exporting(self) -> list[Path]:
        return [p for p in exporting(self.run_dir) if p not in self.leftovers]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], timeout_s: float = 600) -> bool:
        """Poll `ready` every 20 ms; False if the run ended (or the time ran out) first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def kill(self) -> list[tuple[int, str]]:
        """SIGKILL the driver's process group; the run's processes still alive 30 s later (then killed)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        left = wait_until_gone(self.tag, timeout_s=30)
        kill_tagged(self.tag)
        return left

    def finish(self, timeout_s: float = 900) -> tuple[int, list[tuple[int, str]]]:
        """Wait for the run to end by itself; its exit code and its processes alive 30 s later (then killed)."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        left = wait_until_gone(self.tag, timeout_s=30)
        kill_tagged(self.tag)
        return code, left


def workers_ready(launch: Launch) -> bool:
    return "workers ready" in launch.text()


def engine_saving(run_dir: Path) -> list[Path]:
    return list(run_dir.glob("checkpoints/step_*/.*incomplete*"))


def exporting(run_dir: Path) -> list[Path]:
    return list(run_dir.glob(".hf.incomplete*"))


def where_it_landed(launch: Launch) -> str:
    """Where a kill at an arbitrary moment landed, read from what the run left behind."""
    rows = [r for r in read_metrics(launch.run_dir / "metrics.jsonl") if "reward/score/mean" in r]
    if launch.exporting():
        return "mid-export"
    marker = launch.run_dir / "hf" / "megarl_checkpoint.json"
    if marker.is_file() and marker.stat().st_mtime >= launch.wall_start:  # exported by this launch
        return "after the export (the run shutting down)"
    if launch.saving():
        return f"mid-checkpoint (engine save of step {rows[-1]['step'] if rows else '?'})"
    if not workers_ready(launch):
        return "start-up (workers not ready)"
    if not rows and "resumed from" not in launch.text():
        return "before step 1 (baseline validation)"
    last = rows[-1]["step"] if rows else resumed_step(launch.text())
    if last >= TOTAL_STEPS:
        return "after the last step (final validation, export)"
    return f"in step {last + 1} (or its checkpoint)"


def held_where(kind: str, launch: Launch) -> str:
    """Where a hold point froze the run, in words."""
    rows = [r for r in read_metrics(launch.run_dir / "metrics.jsonl") if "reward/score/mean" in r]
    step = rows[-1]["step"] if rows else "?"
    return {
        "driver_state": f"step {step}'s engine checkpoint and manifest written, driver state not yet",
        "checkpoint": f"step {step}'s engine checkpoint written by every rank, not yet published",
        "prune": f"after step {step}'s checkpoint, older ones renamed for deletion",
        "metrics_rewrite": "a relaunch rewriting metrics.jsonl before its first step",
        "export": "the final HF export written, not yet published",
    }[kind]


def resumed_step(log: str) -> int:
    match = re.search(r"resumed from \S+ \(step (\d+)\)", log)
    return int(match.group(1)) if match else 0


# ----------------------------------------------------------------------------- progress and kill kinds


@dataclass
class Progress:
    """What a relaunch of the run will find."""

    step: int
    """Step of the latest intact checkpoint (where a relaunch resumes)."""
    checkpoints: int
    """Intact checkpoints in the run directory."""
    metrics: bool
    """metrics.jsonl exists (a relaunch rewrites it)."""
    exported: bool
    """The final HF export is complete."""

    @property
    def remaining(self) -> int:
        return TOTAL_STEPS - self.step

    @property
    def complete(self) -> bool:
        return self.remaining == 0 and self.exported

    @property
    def prunes(self) -> int:
        """Prunes a relaunch that runs to the end performs (one per save beyond `KEEP` checkpoints)."""
        return max(0, min(self.remaining, self.checkpoints + self.remaining - KEEP))


def progress(run_dir: Path) -> Progress:
    plan = state.plan_resume("auto", run_dir)
    intact = 0 if plan.directory is None else 1 + len(plan.fallbacks)
    return Progress(
        plan.step, intact, (run_dir / "metrics.jsonl").is_file(), (run_dir / "hf" / "megarl_checkpoint.json").is_file()
    )


@dataclass
class Timing:
    """Seconds the uninterrupted run took: launch to workers ready, and workers ready to the end."""

    ready_s: float
    train_s: float


HOLDS = {
    "driver_state": "checkpoint.driver_state",
    "prune": "prune",
    "metrics_rewrite": "metrics.rewrite",
    "checkpoint": "publish.actor",
    "export": "publish.hf",
}
DAMAGES = ("damaged_shard", "damaged_state", "unlisted_damage", "torn_metrics")


def reachable(kind: str, prog: Progress) -> bool:
    steps_left = prog.remaining > 0
    return {
        "checkpoint": steps_left,
        "driver_state": steps_left,
        "prune": prog.prunes > 0,
        "anytime": steps_left,
        "metrics_rewrite": prog.metrics,
        **{k: prog.checkpoints > 0 for k in DAMAGES},
        "unlisted_damage": prog.checkpoints > 1,
    }.get(kind, True)


def hold_env(kind: str, prog: Progress, rng: random.Random, hold_file: Path) -> dict:
    """The fault-injection environment of a hold kind: which occurrence of its point freezes the run."""
    if kind not in HOLDS:
        return {}
    nth = {
        "driver_state": prog.remaining,
        "checkpoint": prog.remaining,
        "prune": prog.prunes,
        "metrics_rewrite": 1,
        "export": 1,
    }[kind]
    return {"MEGARL_FAULT_HOLD": f"{HOLDS[kind]}@{rng.randint(1, nth)}", "MEGARL_FAULT_HOLD_FILE": str(hold_file)}


def trigger(
    kind: str, launch: Launch, rng: random.Random, timing: Timing, prog: Progress, hold_file: Path
) -> Optional[str]:
    """Wait for the kind's moment (None: the run ended first) and say where the kill lands."""
    if kind == "startup":  # a random moment of the start-up, at the latest when the workers are ready
        delay = rng.uniform(0, timing.ready_s)
        if not launch.wait_for(lambda: time.monotonic() - launch.start >= delay or workers_ready(launch)):
            return None
        return f"{time.monotonic() - launch.start:.1f} s after launch: {where_it_landed(launch)}"
    if kind in HOLDS:
        if not launch.wait_for(hold_file.exists):
            return None
        return f"held at {launch.env['MEGARL_FAULT_HOLD']}: {held_where(kind, launch)}"
    if not launch.wait_for(lambda: workers_ready(launch)):
        return None
    ready, delay = time.monotonic(), rng.uniform(0, timing.train_s * max(prog.remaining, 0.5) / TOTAL_STEPS)
    if not launch.wait_for(lambda: time.monotonic() - ready >= delay):
        return None
    return f"{delay:.1f} s after workers ready: {where_it_landed(launch)}"


def damage(kind: str, run_dir: Path) -> str:
    """Damage the run's state as the kind says, after the kill; what was done."""
    if kind == "torn_metrics":
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"step": 99, "reward/score/mean": 0.')
        return "metrics.jsonl: half a line appended"
    latest = state.plan_resume("auto", run_dir).directory
    if latest is None:
        return "no intact checkpoint to damage"
    if kind == "damaged_state":
        (latest / state.DRIVER_STATE).write_bytes(b"")
        return f"{latest.name}/driver_state.pt emptied"
    shard = sorted(latest.glob("actor/*.distcp"))[0]
    if kind == "damaged_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return f"{shard.relative_to(run_dir)} truncated"
    if not state.plan_resume("auto", run_dir).fallbacks:
        return "not damaged: no earlier intact checkpoint to fall back to"
    with open(shard, "r+b") as f:  # same size, no manifest: only the workers' failing load can tell
        f.write(bytes(64))
    (latest / state.MANIFEST).unlink()
    return f"{shard.relative_to(run_dir)}: first 64 bytes zeroed, manifest removed"
