"""Fault soak: kill a short `megarl train` run (SIGKILL of the driver's whole process group) at random
moments, rerun it, and compare every non-timing metric with the uninterrupted run.

    python -m megarl.trainer.fault_soak --points 20 [--seed S] [--root DIR]     (scripts/fault_soak.sh N)

The run (`megarl.trainer.fault_points.soak_overrides`: the quickstart config on the tiny arithmetic
task, one CPU worker, the embedded engine, 4 steps, a checkpoint every step, 2 kept, HF export) is
first run uninterrupted.
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
rerun's metrics and the uninterrupted run's, and the processes left over. No Ray (the runs are
subprocesses).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megarl.trainer.fault_points import (
    DAMAGES,
    KINDS,
    TOTAL_STEPS,
    Launch,
    Progress,
    Timing,
    damage,
    hold_env,
    make_task,
    progress,
    reachable,
    resumed_step,
    trigger,
    workers_ready,
)
from megarl.trainer.metrics import read_metrics

NOT_COMPARED = ("time/", "perf/")


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
        return (
            not self.errors
            and all(not k.left for k in self.kills)
            and all(d <= tol for d in deltas)
            and bool(self.finals)
            and all(same for _, _, same in self.finals)
        )


class Soak:
    def __init__(
        self,
        root: Path,
        points: int,
        seed: int,
        log: Callable[[str], None] = print,
        task: Optional[dict] = None,
        kinds: tuple[str, ...] = KINDS,
    ):
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
        self.log(
            f"kill {len(self.result.kills)}: {kind}: {landed}"
            + (f"; {kill.damage}" if kill.damage else "")
            + (f"; LEFT OVER: {kill.left}" if kill.left else "")
        )
        return kill

    def settle(
        self, previous: Optional[Kill], run: Launch, prog: Progress, final: bool = False, left: Optional[list] = None
    ) -> None:
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
    lines = [
        "| # | run | kill point | where it landed | damage after the kill | rerun resumed from | max abs diff"
        " | left over |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, k in enumerate(result.kills, 1):
        delta = "no rows" if k.delta is None else f"{k.delta:.3g}"
        lines.append(
            f"| {i} | {k.chain} | {k.kind} | {k.landed} | {k.damage or '-'} | {k.resumed} | {delta} | {len(k.left)} |"
        )
    for name, delta, same in result.finals:
        lines.append(
            f"| final | {name} | whole metrics.jsonl | - | - | - | {delta:.3g} over every step"
            f"{'' if same else ' (STEPS DIFFER)'} | - |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fault_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20, help="kills (random moments) in all")
    parser.add_argument("--seed", type=int, default=None, help="seed of the draw (default: random, printed)")
    parser.add_argument("--root", default=None, help="working directory (default: a new one under /tmp)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated kill kinds (default: all: {', '.join(KINDS)})"
    )
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
