"""Observability of a run: phase timers, step metrics, and the sinks they go to.

Owns: `PhaseTimer` (one `with timer("generate"):` per loop phase), `batch_metrics` (rewards, the
share of prompt groups without reward variance, advantages, returns, values, response lengths,
clipped responses, entropy, rollout/train log-prob gap), `reward_metrics` (every key the reward fns
return, overall and per data source), `validation_metrics` (mean@n, pass@n, per data source),
`ZeroVarianceWatch` (the warning when most groups carry no signal step after step), `timing_metrics` (per-phase seconds, tokens/s, the driver's share of the step), and
`RunLogger`: console lines (through the tqdm progress bar over steps), `metrics.jsonl`,
TensorBoard (`torch.utils.tensorboard.SummaryWriter`), optional wandb, rollout samples as JSONL
(`rollouts/step_N.jsonl`) and the reward curve as a PNG (`reward_curve.png`, matplotlib Agg).

No Ray, megatron or vLLM.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from megarl.algorithms import mismatch_metrics
from megarl.data.batch import Batch
from megarl.utils.atomic import stale_writes, write_file

GENERATION_PHASES = ("generate",)
WORKER_PHASES = (
    "old_log_probs",
    "ref_log_probs",
    "values",
    "critic_update",
    "actor_update",
    "weight_sync",
    "engine_sleep",
    "engine_wake",
)


class PhaseTimer:
    """Wall seconds per named phase of one step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return time.perf_counter() - self._start


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()].float()


def _describe(prefix: str, values: torch.Tensor) -> dict:
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def batch_metrics(batch: Batch) -> dict:
    """What the step's data looked like: rewards, advantages, lengths, entropy, rollout/train gap."""
    mask = batch["response_mask"]
    lengths = mask.sum(-1).float()
    out = {
        **_describe("reward/score", batch["scores"]),
        **_describe("response_length", lengths),
        "response_length/clip_ratio": float((batch["finish_reason"] == "length").mean()),
    }
    if "acc" in batch:
        out["reward/acc"] = float(batch["acc"].float().mean())
    if "baseline_rewards" in batch:  # ReMax: the greedy responses' scores
        out["reward/baseline/mean"] = float(batch["baseline_rewards"].mean())
    if "uid" in batch:
        out["rollout/zero_variance_groups"] = zero_variance_share(batch["scores"], batch["uid"])
    if "data_source" in batch:
        out.update(reward_metrics(batch, "reward"))
    for key in ("advantages", "returns", "values"):
        if key in batch:
            out.update(_describe(key, _masked(batch[key], mask)))
    if "token_level_rewards" in batch:
        out["reward/total_mean"] = float(batch["token_level_rewards"].sum(-1).mean())
    if "entropy" in batch:
        out["actor/entropy"] = float(_masked(batch["entropy"], mask).mean())
    if "old_log_probs" in batch:
        gap = mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask)
        out.update({f"rollout/{k}": float(v) for k, v in gap.items()})
    return out


def zero_variance_share(scores: torch.Tensor, group_ids) -> float:
    """Share of prompt groups whose samples all scored the same: no signal for a group baseline."""
    groups: dict = {}
    for group, score in zip(group_ids, scores.tolist()):
        groups.setdefault(group, set()).add(score)
    return sum(len(s) == 1 for s in groups.values()) / max(1, len(groups))


REWARD_SKIP = ("score", "acc", "reward_error")


def _numeric(value) -> bool:
    """int, float or bool (a bool entry, e.g. `formatted`, is logged as a share)."""
    return isinstance(value, (int, float))


def reward_metrics(batch: Batch, prefix: str) -> dict:
    """Means of what the reward fns returned: every extra numeric key overall (`{prefix}/{key}`, e.g.
    reward/format), score, acc and every extra key per data source (`{prefix}/{data_source}/{key}`), and
    the share of rows whose reward fn failed (raised, timed out: `{prefix}/error_rate`)."""
    infos = list(batch["reward_info"]) if "reward_info" in batch else [{}] * len(batch)
    accs = batch["acc"].tolist() if "acc" in batch else None  # one list: indexing the tensor costs µs a row
    rows = [
        {
            "score": float(s),
            **({"acc": float(accs[i])} if accs is not None else {}),
            **{k: float(v) for k, v in (info or {}).items() if k not in REWARD_SKIP and _numeric(v)},
        }
        for i, (s, info) in enumerate(zip(batch["scores"].tolist(), infos))
    ]
    sources = [str(ds) for ds in batch["data_source"]]
    out = {
        f"{prefix}/error_rate": sum((info or {}).get("reward_error") is not None for info in infos) / max(1, len(infos))
    }
    for key in sorted({k for r in rows for k in r}):
        if key not in REWARD_SKIP:
            out[f"{prefix}/{key}"] = _mean_of(rows, key)
        for source in sorted(set(sources)):
            out[f"{prefix}/{source}/{key}"] = _mean_of([r for r, s in zip(rows, sources) if s == source], key)
    return {k: v for k, v in out.items() if v is not None}


def _mean_of(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def pass_at_n(acc: torch.Tensor, group_ids) -> float:
    """Share of prompts (groups) with at least one right response (acc > 0.5)."""
    groups: dict = {}
    for group, right in zip(group_ids, acc.tolist()):
        groups[group] = groups.get(group, False) or right > 0.5
    return sum(groups.values()) / max(1, len(groups))


def validation_metrics(batch: Batch, n: int) -> dict:
    """val/score, val/acc (means over every response: mean@n), val/response_length, the reward fns' keys
    overall and per data source (`val/<data_source>/acc`, ...); with n > 1 responses per prompt also
    val/acc/mean@n and val/acc/pass@n, overall and per data source."""
    out = {
        "val/score": float(batch["scores"].mean()),
        "val/acc": float(batch["acc"].mean()),
        "val/response_length": float(batch["response_mask"].sum(-1).float().mean()),
        **reward_metrics(batch, "val"),
    }
    if n > 1:
        sources = [str(ds) for ds in batch["data_source"]]
        out[f"val/acc/mean@{n}"] = out["val/acc"]
        out[f"val/acc/pass@{n}"] = pass_at_n(batch["acc"], batch["uid"])
        for source in sorted(set(sources)):
            rows = [i for i, s in enumerate(sources) if s == source]
            out[f"val/{source}/acc/mean@{n}"] = float(batch["acc"][rows].mean())
            out[f"val/{source}/acc/pass@{n}"] = pass_at_n(batch["acc"][rows], [batch["uid"][i] for i in rows])
    return out


class ZeroVarianceWatch:
    """Warns once when more than half of the prompt groups had no reward variance (every sample scored
    the same: zero advantage under a group baseline) in each of `steps` steps in a row."""

    def __init__(self, steps: int):
        self.steps, self.run, self.warned = steps, 0, False

    def update(self, metrics: dict) -> Optional[str]:
        """The warning to print after this step's metrics, or None."""
        share = metrics.get("rollout/zero_variance_groups")
        if not self.steps or share is None or self.warned:
            return None
        self.run = self.run + 1 if share > 0.5 else 0
        if self.run < self.steps:
            return None
        self.warned = True
        score = metrics.get("reward/score/mean", float("nan"))
        return (
            f"[megarl] WARNING: in each of the last {self.run} steps more than half of the prompt groups had the"
            f" same reward for every sample (rollout/zero_variance_groups={share:.2f}, mean score {score:.3g}):"
            " group estimators (grpo, rloo, ...) give those samples zero advantage, so most of the batch"
            " teaches nothing. Pick prompts the policy sometimes solves (neither always right nor always"
            " wrong), raise rollout.samples_per_prompt or rollout.temperature, or keep only groups with"
            " signal (algorithm.dapo.filter_groups=true). This warning is shown once"
            " (trainer.zero_variance_warn_steps sets the run length; 0 turns it off)."
        )


class MFUMeter:
    """Model FLOPs utilisation of the actor update: its FLOPs (6·N·T + attention, per epoch) over the
    actor GPUs' peak for the phase's seconds. Only built for GPU runs (`mfu_meter`)."""

    def __init__(self, dims, gpus: int, peak_tflops: float, epochs: int):
        self.dims, self.gpus, self.peak_tflops, self.epochs = dims, gpus, peak_tflops, epochs

    def __call__(self, batch: Batch, seconds: float) -> float:
        from megarl.models.flops import train_flops

        flops = self.epochs * train_flops(self.dims, batch["attention_mask"].sum(-1))
        return flops / (seconds * self.gpus * self.peak_tflops * 1e12) if seconds > 0 else 0.0


def mfu_meter(cfg, derived) -> Optional[MFUMeter]:
    """An `MFUMeter` for GPU runs; None on CPU (MFU against a CPU peak means nothing)."""
    if cfg.resources.accelerator != "gpu":
        return None
    from megarl.models.hf_config import describe_hf_config, load_hf_config

    dims = describe_hf_config(load_hf_config(cfg.model.hf_path))
    return MFUMeter(dims, derived.role_world["actor"], cfg.resources.gpu_peak_tflops, cfg.actor.epochs_per_step)


def timing_metrics(timer: PhaseTimer, batch: Batch, mfu: Optional[MFUMeter] = None) -> dict:
    """Seconds per phase, throughput, the share of the step spent outside generation and workers,
    and (GPU runs) the actor update's MFU."""
    step = timer.total
    out = {f"time/{phase}": seconds for phase, seconds in timer.seconds.items()}
    out["time/step"] = step
    busy = sum(timer.seconds.get(p, 0.0) for p in GENERATION_PHASES + WORKER_PHASES)
    out["time/driver_overhead_share"] = max(0.0, step - busy) / step if step > 0 else 0.0
    tokens = float(batch["attention_mask"].sum())
    out["perf/tokens_per_s"] = tokens / step if step > 0 else 0.0
    generated = float(batch["response_mask"].sum())
    gen_time = timer.seconds.get("generate", 0.0)
    out["perf/generated_tokens_per_s"] = generated / gen_time if gen_time > 0 else 0.0
    if mfu is not None and "actor_update" in timer.seconds:
        out["perf/mfu_actor_update"] = mfu(batch, timer.seconds["actor_update"])
    return out


def mean_metrics(updates: list[dict], prefix: str) -> dict:
    """Mean of each numeric metric over a step's optimizer updates, under `prefix/`."""
    out: dict[str, float] = {}
    keys = {k for u in updates for k, v in u.items() if isinstance(v, (int, float))}
    for key in sorted(keys):
        values = [float(u[key]) for u in updates if key in u]
        out[f"{prefix}/{key}"] = sum(values) / len(values)
    if updates:
        out[f"{prefix}/updates"] = float(len(updates))
    return out


# ----------------------------------------------------------------------------- sinks


class RunLogger:
    """Console (+ progress bar), metrics.jsonl, TensorBoard, wandb, rollout dumps and the reward plot."""

    def __init__(self, cfg, start_step: int = 0, append_only: bool = False):
        """append_only (trainer.val_only): keep every line already in metrics.jsonl and TensorBoard, no
        progress bar; otherwise lines of steps after `start_step` (a killed run's) are dropped."""
        tr = cfg.trainer
        self.run_dir = Path(tr.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers, self.every = set(tr.loggers), tr.log_every_steps
        self.jsonl = self.run_dir / "metrics.jsonl"
        if not append_only:
            _truncate_after(self.jsonl, start_step)
        purge = start_step if not append_only else 0
        self.tb = self._tensorboard(purge) if "tensorboard" in self.loggers else None
        self.wandb = self._wandb(cfg) if "wandb" in self.loggers else None
        self.bar = self._progress(tr, start_step) if not append_only else None

    def _tensorboard(self, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def _wandb(self, cfg):
        import wandb

        return wandb.init(
            project=cfg.trainer.project, name=cfg.trainer.experiment, dir=str(self.run_dir), resume="allow"
        )

    def _progress(self, tr, start_step: int):
        if not tr.progress_bar:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=tr.total_steps, initial=start_step, desc=tr.experiment, unit="step", dynamic_ncols=True)

    def print(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def log(self, step: int, metrics: dict, *, advance: bool = True) -> None:
        """Record one step's metrics (or a validation at `step` with advance=False) in every sink."""
        metrics = {k: float(v) for k, v in metrics.items()}
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if "console" in self.loggers and (not advance or step % self.every == 0):
            self.print(console_line(step, metrics))
        if self.bar is not None and advance:
            self.bar.update(1)
            self.bar.set_postfix(_postfix(metrics), refresh=False)

    def dump_rollouts(self, step: int, records: list[dict]) -> Path:
        path = self.run_dir / "rollouts" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        return path

    def plot(self) -> Optional[Path]:
        """reward_curve.png: training score and validation score per step."""
        return plot_reward_curve(self.jsonl, self.run_dir / "reward_curve.png")

    def summary(self) -> str:
        """One line: validation score (accuracy) at the first and the last validation."""
        found = validation_summary(read_metrics(self.jsonl))
        if found is None:
            return "no validation ran (set validation.files)"
        (s0, v0, a0), (s1, v1, a1) = found
        return f"validation score {v0:.3f} (acc {a0:.2f}) at step {s0} -> {v1:.3f} (acc {a1:.2f}) at step {s1}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


CONSOLE_KEYS = (
    "reward/score/mean",
    "reward/acc",
    "val/score",
    "val/acc",
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/loss",
    "actor/entropy",
    "response_length/mean",
    "rollout/mismatch_abs_mean",
    "time/step",
)


def console_line(step: int, metrics: dict) -> str:
    shown = [f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics]
    return f"step {step}: " + " ".join(shown)


def _postfix(metrics: dict) -> dict:
    return {
        k.split("/")[-2] if k.endswith("/mean") else k.split("/")[-1]: f"{metrics[k]:.3g}"
        for k in ("reward/score/mean", "time/step")
        if k in metrics
    }


def _truncate_after(path: Path, step: int) -> None:
    """Drop lines of steps after `step` (written by a run that was killed before its next checkpoint;
    step 0, a run starting over: every line, its step-0 validation included) and lines that do not
    parse (a run killed mid-write leaves a torn last line), with a warning. The file is replaced
    atomically: a kill during the rewrite leaves the old file or the new one."""
    if not path.is_file():
        return
    rows = _parsed_lines(path, warn=True)
    kept = [line for line, row in rows if row["step"] <= step] if step > 0 else []
    for stale in stale_writes(path):  # left by a run killed mid-rewrite
        stale.unlink(missing_ok=True)
    write_file(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)), fault="metrics.rewrite")


def _parsed_lines(path: Path, warn: bool = False) -> list[tuple[str, dict]]:
    """(line, row) of every line of a metrics JSONL that parses to a row with a step; others skipped."""
    rows = []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            int(row["step"])
        except (ValueError, KeyError, TypeError) as err:
            if warn:
                where = "its last line" if number == len(lines) else f"line {number}"
                print(
                    f"[megarl] warning: {path} {where} does not parse ({type(err).__name__}: {err}; a run killed"
                    " while writing it); dropped",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        rows.append((line, row))
    return rows


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics JSONL (lines that do not parse, e.g. a torn last line, are skipped)."""
    path = Path(path)
    return [row for _, row in _parsed_lines(path)] if path.is_file() else []


def validation_summary(rows: list[dict]) -> Optional[tuple[tuple[int, float, float], tuple[int, float, float]]]:
    """((step, score, acc) of the first validation, (step, score, acc) of the last), or None."""
    vals = [(r["step"], r["val/score"], r.get("val/acc", float("nan"))) for r in rows if "val/score" in r]
    return (vals[0], vals[-1]) if vals else None


def _moving_average(values, window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curve(jsonl: str | Path, out: str | Path) -> Optional[Path]:
    """Plot reward/score/mean (training) and val/score (validation) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    train = [(r["step"], r["reward/score/mean"]) for r in rows if "reward/score/mean" in r]
    val = [(r["step"], r["val/score"]) for r in rows if "val/score" in r and not math.isnan(r["val/score"])]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, scores = zip(*train)
        ax.plot(steps, scores, label="train reward (mean score)", alpha=0.35)
        ax.plot(steps, _moving_average(scores, max(1, len(scores) // 20)), label="train reward (moving average)")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation reward (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
