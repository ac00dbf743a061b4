"""Fit the schedule model's constants to a synchronous run: its metrics.jsonl and config.yaml.

Per training step of the run (rows with `time/step`):
* decode: the slowest engine decodes about `response_length/max` steps with, summed over its steps,
  (samples per engine) x `response_length/mean` running sequences, so
  `time/generate ~ base_s * max + per_seq_s * (batch / engines) * mean`; least squares over the steps
  (non-negative; when the steps do not vary enough to tell the two apart, the better single term).
  Exact when one engine holds the whole batch in its slots; the time of prompt processing, request
  handling and detokenisation is absorbed into the two constants.
* trainer: (`time/step` - `time/generate` - `time/weight_sync`) / batch samples = `train_s_per_sample`.
* weight sync: the mean `time/weight_sync`.
* lengths: a lognormal clipped at `rollout.max_response_tokens` matching the mean response length and,
  if some responses were clipped, `response_length/clip_ratio`, else the (geometric) mean of the
  per-step maxima as the expected maximum of a batch.
Batch size, engines and the cap come from the run's config.yaml (`rollout.mode=server`: the rollout
pool's GPUs / rollout.tp engines; colocated: every GPU).

Pure Python (reads JSON and YAML); imports nothing from megarl outside this package.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist, fmean
from typing import Optional

from megarl.utils.simulate.model import Costs, Decode, Layout, Lengths, SimConfig

_NORMAL = NormalDist()


def read_rows(run_dir: str | Path) -> list[dict]:
    """The training-step rows of RUN_DIR/metrics.jsonl (lines that do not parse are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"--calibrate {run_dir}: no metrics.jsonl there (a `megarl train` run directory?)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "time/step" in row and "time/generate" in row:
            rows.append(row)
    if not rows:
        raise ValueError(f"--calibrate {run_dir}: metrics.jsonl has no training step with time/step and time/generate")
    if any("async/staleness_max" in r for r in rows):
        raise ValueError(
            f"--calibrate {run_dir}: an asynchronous run; calibrate from a trainer.mode=sync run "
            "(its phases do not overlap, so their times are the model's constants)"
        )
    return rows


def read_run_config(run_dir: str | Path) -> dict:
    """RUN_DIR/config.yaml as a dict (empty when absent)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def layout_of(config: dict, max_seqs: int) -> Layout:
    """Engines of a run: the rollout pool's GPUs / rollout.tp in server mode, every GPU when colocated."""
    rollout, res = config.get("rollout", {}), config.get("resources", {})
    tp = int(rollout.get("tp", 1))
    total = int(res.get("nodes", 1)) * int(res.get("gpus_per_node", 1))
    pools = res.get("pools") or {}
    if rollout.get("mode") == "server" and rollout.get("pool") in pools:
        gpus = int(pools[rollout["pool"]])
        return Layout(rollout_gpus=gpus, train_gpus=max(1, total - gpus), engine_tp=tp, max_seqs_per_engine=max_seqs)
    return Layout(rollout_gpus=total, train_gpus=total, engine_tp=tp, max_seqs_per_engine=max_seqs)


def fit_decode(rows: list[dict], samples_per_engine: float) -> Decode:
    """base_s, per_seq_s from time/generate ~ base_s * max length + per_seq_s * samples_per_engine * mean length."""
    xs = [(r["response_length/max"], samples_per_engine * r["response_length/mean"]) for r in rows]
    ys = [r["time/generate"] for r in rows]
    a11, a12, a22 = (sum(x[0] * x[0] for x in xs), sum(x[0] * x[1] for x in xs), sum(x[1] * x[1] for x in xs))
    b1, b2 = sum(x[0] * y for x, y in zip(xs, ys)), sum(x[1] * y for x, y in zip(xs, ys))
    det = a11 * a22 - a12 * a12
    if det > 1e-9 * a11 * a22:
        base, per_seq = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
        if base >= 0 and per_seq >= 0:
            return Decode(base_s=base, per_seq_s=per_seq)
    only_base, only_seq = b1 / a11, b2 / a22  # one term alone: the one leaving the smaller residual

    def residual(base: float, per_seq: float) -> float:
        return sum((y - base * x[0] - per_seq * x[1]) ** 2 for x, y in zip(xs, ys))

    if residual(only_base, 0.0) <= residual(0.0, only_seq):
        return Decode(base_s=only_base, per_seq_s=0.0)
    return Decode(base_s=0.0, per_seq_s=only_seq)


def _clipped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X lognormal(mu, sigma)."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * _NORMAL.cdf(z - sigma) + cap * (1 - _NORMAL.cdf(z))


def fit_lengths(mean: float, max_geo: float, clip: float, cap: int, batch: int) -> Lengths:
    """A lognormal clipped at `cap` with this mean and either this clipped share (clip > 0) or this
    expected batch maximum (Blom's approximation of the expected maximum of `batch` normals)."""
    if clip > 0:  # mu + sigma * z = ln cap, and the clipped mean matches: bisect on sigma
        z = _NORMAL.inv_cdf(min(1 - 1e-6, 1 - clip))
        low, high = 1e-3, 5.0
        for _ in range(100):
            sigma = (low + high) / 2
            # with the clipped share fixed, a larger sigma spreads the unclipped mass down: the mean falls
            if _clipped_mean(math.log(cap) - sigma * z, sigma, cap) > mean:
                low = sigma
            else:
                high = sigma
        return Lengths(median=cap * math.exp(-sigma * z), sigma=sigma, max_tokens=cap)
    e_max = _NORMAL.inv_cdf((batch - 0.375) / (batch + 0.25)) if batch > 1 else 0.0
    gap = math.log(max(max_geo, mean) / mean)  # ln max - ln mean = sigma e_max - sigma^2 / 2
    sigma = e_max - math.sqrt(e_max * e_max - 2 * gap) if e_max * e_max > 2 * gap else e_max
    return Lengths(median=mean * math.exp(-sigma * sigma / 2), sigma=sigma, max_tokens=cap)


def calibrate(
    run_dir: str | Path, max_seqs: int = 256, layout: Optional[Layout] = None, skip_steps: int = 1, **overrides
) -> SimConfig:
    """A `SimConfig` fitted to a synchronous run (see the module docstring), its first `skip_steps` steps left
    out (start-up, compilation) when it has more; `overrides`: SimConfig fields (prompts_per_step,
    samples_per_prompt, ...) that the run's config.yaml lacks or that should differ."""
    rows, config = read_rows(run_dir), read_run_config(run_dir)
    rows = rows[skip_steps:] if len(rows) > skip_steps else rows
    trainer, rollout = config.get("trainer", {}), config.get("rollout", {})
    prompts = overrides.pop("prompts_per_step", None) or trainer.get("prompts_per_step")
    n = overrides.pop("samples_per_prompt", None) or rollout.get("samples_per_prompt")
    if not prompts or not n:
        raise ValueError(
            f"--calibrate {run_dir}: no config.yaml with trainer.prompts_per_step and "
            "rollout.samples_per_prompt; pass --prompts-per-step and --samples-per-prompt"
        )
    layout = layout or layout_of(config, max_seqs)
    batch = prompts * n
    cap = int(rollout.get("max_response_tokens") or max(r["response_length/max"] for r in rows))
    lengths = fit_lengths(
        fmean(r["response_length/mean"] for r in rows),
        math.exp(fmean(math.log(max(1.0, r["response_length/max"])) for r in rows)),
        fmean(r.get("response_length/clip_ratio", 0.0) for r in rows),
        cap,
        batch,
    )
    sync = fmean(r.get("time/weight_sync", 0.0) for r in rows)
    train = fmean((r["time/step"] - r["time/generate"] - r.get("time/weight_sync", 0.0)) / batch for r in rows)
    decode = fit_decode(rows, batch / layout.engines)
    return SimConfig(
        layout=layout,
        lengths=lengths,
        decode=decode,
        costs=Costs(max(0.0, train), sync),
        prompts_per_step=prompts,
        samples_per_prompt=n,
        name=f"calibrated on {run_dir}",
        **overrides,
    )


def measured_samples_per_s(run_dir: str | Path, batch: int, skip: int = 1) -> float:
    """The run's own samples/s over its steps (the first `skip` left out: start-up and compilation)."""
    rows = read_rows(run_dir)
    kept = rows[skip:] if len(rows) > skip else rows
    return batch * len(kept) / sum(r["time/step"] for r in kept)
