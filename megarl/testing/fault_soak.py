"""Fault soak: kill a short `megarl train` run (SIGKILL of the driver's whole process group) at random
moments, rerun it, and compare every non-timing metric with the uninterrupted run.

    python -m megarl.testing.fault_soak --points 20 [--seed S] [--root DIR]     (scripts/fault_soak.sh N)

The run (`soak_overrides`: the quickstart config on the tiny arithmetic task, one CPU worker, the
embedded engine, 4 steps, a checkpoint every step, 2 kept, HF export) is first run uninterrupted.
Then a chain: launch, kill at the next point, relaunch the same command (it resumes), kill at the
following point, ..., then let it finish; a run that completes before the points are used up starts
a new chain in a fresh run directory. Kill points (`KINDS`, drawn in a shuffled cycle, skipping
those the run cannot reach any more):

  startup          a random moment between launch and the first step
  anytime          a random moment of the training (a step, a checkpoint, validation, the export)
  checkpoint       the actor's engine checkpoint written by every rank, not yet published  (hold)
  driver_state     engine checkpoints and manifest written, driver state not yet            (hold)
  prune            old checkpoints renamed for deletion, not deleted yet                   (hold)
  metrics_rewrite  a relaunched run rewriting metrics.jsonl                                 (hold)
  export           the final HF export written, not yet published                          (hold)
  damaged_shard    anytime, then a shard of the latest checkpoint is truncated
  damaged_state    anytime, then the latest checkpoint's driver_state.pt is emptied
  unlisted_damage  anytime, then the latest checkpoint loses its manifest and the head of a shard is
                   zeroed (same size: only the workers' failing load can tell, the second line of
                   defence; done only where an older intact checkpoint exists to fall back to)
  torn_metrics     anytime, then half a JSON line is appended to metrics.jsonl

After each kill every process of the run (found by its MEGARL_RUN_TAG) must be gone within 30 s.
The table gives, per kill, where it landed, the step the rerun resumed from, the max |Δ| between the
rerun's metrics and the uninterrupted run's, and the processes left over. Standard library + megarl.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megarl.testing.processes import TAG_VAR, kill_tagged, wait_until_gone
from megarl.trainer import state
from megarl.trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
KINDS = ("startup", "anytime", "checkpoint", "driver_state", "prune", "metrics_rewrite", "export",
         "damaged_shard", "damaged_state", "unlisted_damage", "torn_metrics")
NOT_COMPARED = ("time/", "perf/")
TOTAL_STEPS, KEEP = 4, 2


def soak_overrides(task: dict, run_dir: Path) -> list[str]:
    return [f"model.hf_path={task['model']}", f"data.files=[{task['train']}]", f"validation.files=[{task['test']}]",
            "data.apply_chat_template=false", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "validation.max_prompts=4", "validation.every_steps=2", "trainer.progress_bar=false",
            f"trainer.run_dir={run_dir}", "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0",
            "rollout.engine=embedded", "resources.gpus_per_node=1", "actor.layout.tp=1",
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.checkpoint_every_steps=1", f"trainer.keep_checkpoints={KEEP}",
            "trainer.dump_rollouts_every_steps=0", "trainer.loggers=[console,jsonl]", "trainer.export_hf_at_end=true"]


def make_task(root: Path) -> dict:
    """The tiny policy (Qwen2, 2 layers, hidden 64) with the character tokenizer and arithmetic prompts."""
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_hf_model

    tok = build_tiny_tokenizer()
    save_tiny_hf_model("qwen2", root / "model", vocab_size=len(tok), hidden_size=64, num_heads=2, num_kv_heads=2,
                       tokenizer=tok, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return {"model": str(root / "model"), **write_task_splits("arithmetic", 200, str(root / "data"), chat=False)}


# ----------------------------------------------------------------------------- one launched run


class Launch:
    """`megarl train` in its own session (its process group is the driver's), tagged, logging to a file."""

    def __init__(self, task: dict, run_dir: Path, log: Path, env: Optional[dict] = None):
        self.run_dir, self.log, self.env = run_dir, log, dict(env or {})
        self.tag = f"soak-{os.getpid()}-{time.time_ns()}"
        command = [sys.executable, "-m", "megarl.cli", "train", "--config", str(REPO / "configs/grpo_quickstart.yaml"),
                   *soak_overrides(task, run_dir)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, TAG_VAR: self.tag, **self.env})
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
    return {"driver_state": f"step {step}'s engine checkpoint and manifest written, driver state not yet",
            "checkpoint": f"step {step}'s engine checkpoint written by every rank, not yet published",
            "prune": f"after step {step}'s checkpoint, older ones renamed for deletion",
            "metrics_rewrite": "a relaunch rewriting metrics.jsonl before its first step",
            "export": "the final HF export written, not yet published"}[kind]


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
    return Progress(plan.step, intact, (run_dir / "metrics.jsonl").is_file(),
                    (run_dir / "hf" / "megarl_checkpoint.json").is_file())


@dataclass
class Timing:
    """Seconds the uninterrupted run took: launch to workers ready, and workers ready to the end."""

    ready_s: float
    train_s: float


HOLDS = {"driver_state": "checkpoint.driver_state", "prune": "prune", "metrics_rewrite": "metrics.rewrite",
         "checkpoint": "publish.actor", "export": "publish.hf"}
DAMAGES = ("damaged_shard", "damaged_state", "unlisted_damage", "torn_metrics")


def reachable(kind: str, prog: Progress) -> bool:
    steps_left = prog.remaining > 0
    return {"checkpoint": steps_left, "driver_state": steps_left, "prune": prog.prunes > 0, "anytime": steps_left,
            "metrics_rewrite": prog.metrics, **{k: prog.checkpoints > 0 for k in DAMAGES},
            "unlisted_damage": prog.checkpoints > 1}.get(kind, True)


def hold_env(kind: str, prog: Progress, rng: random.Random, hold_file: Path) -> dict:
    """The fault-injection environment of a hold kind: which occurrence of its point freezes the run."""
    if kind not in HOLDS:
        return {}
    nth = {"driver_state": prog.remaining, "checkpoint": prog.remaining, "prune": prog.prunes, "metrics_rewrite": 1,
           "export": 1}[kind]
    return {"MEGARL_FAULT_HOLD": f"{HOLDS[kind]}@{rng.randint(1, nth)}", "MEGARL_FAULT_HOLD_FILE": str(hold_file)}


def trigger(kind: str, launch: Launch, rng: random.Random, timing: Timing, prog: Progress,
            hold_file: Path) -> Optional[str]:
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


# ----------------------------------------------------------------------------- comparing metrics


def max_delta(rows: list[dict], baseline: list[dict]) -> float:
    """Max |Δ| over every non-timing metric of `rows` against the baseline's row of the same step
    (inf for a step or a metric the other side lacks)."""
    by_step = {r["step"]: r for r in baseline}
    worst = 0.0
    for row in rows:
        base = by_step.get(row["step"])
        if base is None:
            return math.inf
        keys = {k for k in {*row, *base} if not k.startswith(NOT_COMPARED)}
        for key in keys:
            a, b = row.get(key), base.get(key)
            if a is None or b is None:
                return math.inf
            if not (math.isnan(a) and math.isnan(b)):
                worst = max(worst, abs(a - b))
    return worst


def rows_after(run_dir: Path, step: int) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > step]


# ----------------------------------------------------------------------------- the soak


@dataclass
class Kill:
    """One kill of the chain and what the rerun after it did."""

    kind: str
    landed: str
    chain: str = ""
    """The run directory (chain) the kill happened in."""
    left: list = field(default_factory=list)
    """Processes of the run alive 30 s after the kill."""
    damage: str = ""
    resumed: str = "-"
    """The step the next launch resumed from (and any fallback it reported)."""
    delta: Optional[float] = None
    """Max |Δ| of the next launch's metrics against the uninterrupted run (None: it wrote none)."""


@dataclass
class SoakResult:
    seed: int
    kills: list[Kill] = field(default_factory=list)
    finals: list[tuple[str, float, bool]] = field(default_factory=list)
    """Per chain: run dir, max |Δ| of the whole metrics file, whether its steps equal the baseline's."""
    errors: list[str] = field(default_factory=list)

    def ok(self, tol: float = 1e-6) -> bool:
        deltas = [k.delta for k in self.kills if k.delta is not None] + [d for _, d, _ in self.finals]
        return (not self.errors and all(not k.left for k in self.kills) and all(d <= tol for d in deltas)
                and bool(self.finals) and all(same for _, _, same in self.finals))


class Soak:
    def __init__(self, root: Path, points: int, seed: int, log: Callable[[str], None] = print,
                 task: Optional[dict] = None, kinds: tuple[str, ...] = KINDS):
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or not kinds:
            raise ValueError(f"kill kinds {unknown or kinds!r}: pick from {', '.join(KINDS)}")
        self.root, self.points, self.log, self.kinds = root, points, log, tuple(kinds)
        self.rng, self.result = random.Random(seed), SoakResult(seed)
        self.task = task or make_task(root / "task")
        self.order: list[str] = []
        self.launches = 0

    def launch(self, run_dir: Path, env: Optional[dict] = None) -> Launch:
        self.launches += 1
        return Launch(self.task, run_dir, self.root / f"launch_{self.launches:02d}.log", env)

    def baseline(self) -> None:
        run = self.launch(self.root / "uninterrupted")
        ready = run.wait_for(lambda: workers_ready(run))
        ready_s = time.monotonic() - run.start
        run.wait_for((run.run_dir / "hf" / "megarl_checkpoint.json").is_file)  # training + export done
        train_s = time.monotonic() - run.start - ready_s
        code, left = run.finish()
        if code != 0 or not ready or left:
            raise RuntimeError(f"the uninterrupted run failed (exit {code}, left over {left}); see {run.log}")
        self.timing = Timing(ready_s, train_s)
        self.reference = read_metrics(run.run_dir / "metrics.jsonl")
        self.log(f"uninterrupted run: workers ready after {ready_s:.1f} s, trained in {self.timing.train_s:.1f} s")

    def next_kind(self, prog: Progress) -> str:
        """The next kind of a shuffled cycle that the run can still reach (unreachable ones wait their turn)."""
        for _ in range(2):
            for i, kind in enumerate(self.order):
                if reachable(kind, prog):
                    return self.order.pop(i)
            self.order += self.rng.sample(self.kinds, len(self.kinds))
        return "startup"

    def run(self) -> SoakResult:
        self.baseline()
        chain, previous = 0, None
        while len(self.result.kills) < self.points and not self.result.errors:
            run_dir = self.root / f"chain_{chain}"
            if progress(run_dir).complete:  # a kill landed after the export, or the run ended by itself
                self.complete_chain(run_dir, previous)
                chain, previous = chain + 1, None
                continue
            previous = self.kill_once(run_dir, previous)
        if not self.result.errors:
            self.finish_chain(self.root / f"chain_{chain}", previous)
        return self.result

    def kill_once(self, run_dir: Path, previous: Optional[Kill]) -> Optional[Kill]:
        """Launch, kill at the next point, note where it landed; the launch is also `previous`'s rerun."""
        run_dir.mkdir(parents=True, exist_ok=True)
        prog = progress(run_dir)
        kind = self.next_kind(prog)
        hold_file = self.root / f"hold_{self.launches + 1:02d}"
        run = self.launch(run_dir, hold_env(kind, prog, self.rng, hold_file))
        landed = trigger(kind, run, self.rng, self.timing, prog, hold_file)
        if landed is None:  # the run ended before the moment came: it is this chain's final run
            self.order.insert(0, kind)
            self.settle(previous, run, prog, final=True, left=run.finish()[1])
            return None
        kill = Kill(kind, landed, run_dir.name, run.kill())
        self.settle(previous, run, prog)
        if kind in DAMAGES:
            kill.damage = damage(kind, run_dir)
        self.result.kills.append(kill)
        self.log(f"kill {len(self.result.kills)}: {kind}: {landed}" + (f"; {kill.damage}" if kill.damage else "")
                 + (f"; LEFT OVER: {kill.left}" if kill.left else ""))
        return kill

    def settle(self, previous: Optional[Kill], run: Launch, prog: Progress, final: bool = False,
               left: Optional[list] = None) -> None:
        """Record what `run` (the rerun after `previous`) resumed from and how its metrics compare."""
        text = run.text()
        if final and (run.proc.returncode != 0 or left):
            self.result.errors.append(f"{run.log}: exit {run.proc.returncode}, left over {left}: {text[-2000:]}")
        if previous is not None:
            fell_back = " (passed over a damaged checkpoint)" if "is damaged" in text else ""
            fell_back += " (a load failed, fell back)" if "loading checkpoint" in text else ""
            fresh = prog.step == 0 and workers_ready(run)
            resumed = resumed_step(text) if "resumed from" in text else 0 if fresh else None
            previous.resumed = "killed before resuming" if resumed is None else f"step {resumed}{fell_back}"
            rows = rows_after(run.run_dir, resumed if resumed is not None else TOTAL_STEPS)
            previous.delta = max_delta(rows, self.reference) if rows else None
        if final:
            rows = read_metrics(run.run_dir / "metrics.jsonl")
            same = [r["step"] for r in rows] == [r["step"] for r in self.reference]
            self.result.finals.append((run.run_dir.name, max_delta(rows, self.reference), same))

    def complete_chain(self, run_dir: Path, previous: Optional[Kill]) -> None:
        """A chain that is complete without a final launch: compare its whole metrics file."""
        if previous is not None:
            previous.resumed = "nothing left: the run was complete"
        if all(name != run_dir.name for name, _, _ in self.result.finals):
            rows = read_metrics(run_dir / "metrics.jsonl")
            same = [r["step"] for r in rows] == [r["step"] for r in self.reference]
            self.result.finals.append((run_dir.name, max_delta(rows, self.reference), same))

    def finish_chain(self, run_dir: Path, previous: Optional[Kill]) -> None:
        prog = progress(run_dir)
        if prog.complete:
            self.complete_chain(run_dir, previous)
            return
        run = self.launch(run_dir)
        self.settle(previous, run, prog, final=True, left=run.finish()[1])


def table(result: SoakResult) -> str:
    lines = ["| # | run | kill point | where it landed | damage after the kill | rerun resumed from | max abs diff"
             " | left over |", "|---|---|---|---|---|---|---|---|"]
    for i, k in enumerate(result.kills, 1):
        delta = "no rows" if k.delta is None else f"{k.delta:.3g}"
        lines.append(f"| {i} | {k.chain} | {k.kind} | {k.landed} | {k.damage or '-'} | {k.resumed} | {delta}"
                     f" | {len(k.left)} |")
    for name, delta, same in result.finals:
        lines.append(f"| final | {name} | whole metrics.jsonl | - | - | - | {delta:.3g} over every step"
                     f"{'' if same else ' (STEPS DIFFER)'} | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fault_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20, help="kills (random moments) in all")
    parser.add_argument("--seed", type=int, default=None, help="seed of the draw (default: random, printed)")
    parser.add_argument("--root", default=None, help="working directory (default: a new one under /tmp)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kill kinds (default: all: {', '.join(KINDS)})")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    import tempfile

    root = Path(args.root or tempfile.mkdtemp(prefix="megarl_fault_soak_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"fault soak: {args.points} points, seed {seed}, in {root}", flush=True)
    start = time.monotonic()
    result = Soak(root, args.points, seed, log=lambda m: print(m, flush=True), kinds=tuple(args.kinds.split(","))).run()
    print(table(result))
    for error in result.errors:
        print(f"ERROR: {error}")
    print(f"{'ok' if result.ok() else 'FAILED'} in {time.monotonic() - start:.0f} s (seed {seed})")
    return 0 if result.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
