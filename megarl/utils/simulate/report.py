"""Run the schedules of one `SimConfig` side by side and format what `megarl simulate` prints.

Pure Python; imports nothing from megarl outside this package.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Optional, Sequence

from megarl.utils.simulate.model import Async, SimConfig
from megarl.utils.simulate.presets import PUBLISHED
from megarl.utils.simulate.schedules import Result, simulate_async, simulate_sync


def compare(cfg: SimConfig, staleness: Sequence[int], knobs: Async, colocated: bool = False) -> dict:
    """{"sync": Result, "colocated": Result or None, "async": {max_staleness: Result}}."""
    return {
        "sync": simulate_sync(cfg),
        "colocated": simulate_sync(cfg.colocated()) if colocated else None,
        "async": {s: simulate_async(cfg, replace(knobs, max_staleness=s)) for s in staleness},
    }


def describe(cfg: SimConfig) -> list[str]:
    lay, ln, dec, cost = cfg.layout, cfg.lengths, cfg.decode, cfg.costs
    lengths = (
        f"{len(ln.measured)} measured lengths"
        if ln.measured
        else f"lognormal median {ln.median:.0f} sigma {ln.sigma:.2f}"
    )
    return [
        f"scenario: {cfg.name}",
        f"  layout: {lay.rollout_gpus} rollout GPUs as {lay.engines} engine(s) of TP{lay.engine_tp}, "
        f"{lay.max_seqs_per_engine} sequences each; {lay.train_gpus} training GPUs",
        f"  batch: {cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples = {cfg.batch_samples}; "
        f"{cfg.steps} updates ({cfg.warmup_steps} warm-up left out), seed {cfg.seed}",
        f"  lengths: {lengths}, cap {ln.max_tokens} (mean {ln.mean():.0f} tokens)",
        f"  decode step: {dec.base_s * 1e3:.3f} ms + {dec.per_seq_s * 1e3:.4f} ms per running sequence",
        f"  trainer: {cost.train_s_per_sample * 1e3:.3f} ms per sample; weight sync {cost.weight_sync_s:.3f} s",
    ]


def _row(label: str, r: Result, base: Result) -> str:
    return (
        f"  {label:<28} {r.samples_per_s:>10.3f} {r.samples_per_s / base.samples_per_s:>8.2f}x {r.step_s:>9.2f}"
        f" {r.engine_idle_share:>8.3f} {r.occupancy:>8.3f} {r.trainer_idle_share:>9.3f} {r.staleness_max:>6d}"
        f" {r.staleness_mean:>6.2f} {r.dropped_groups:>7d}"
    )


def format_report(cfg: SimConfig, results: dict, knobs: Async, measured: Optional[float] = None) -> str:
    base = results["sync"]
    lines = describe(cfg) + [
        f"  async: over_stale={knobs.over_stale} on_update={knobs.on_update} "
        f"max_concurrent_rollouts={knobs.max_concurrent_rollouts}",
        "",
        f"  {'schedule':<28} {'samples/s':>10} {'vs sync':>9} {'s/update':>9} {'eng.idle':>8} {'eng.occ':>8}"
        f" {'trn.idle':>9} {'stale':>6} {'mean':>6} {'dropped':>7}",
        _row("sync", base, base),
    ]
    if results.get("colocated") is not None:
        lines.append(_row("sync, colocated (all GPUs)", results["colocated"], base))
    for s, r in results["async"].items():
        lines.append(_row(f"async, max_staleness={s}", r, base))
    if measured is not None:
        lines.append(
            f"\n  measured sync samples/s of the calibration run: {measured:.3f} "
            f"(model: {base.samples_per_s:.3f}, {base.samples_per_s / measured:.2f}x of measured)"
        )
    if results.get("colocated") is not None:
        best = max(r.samples_per_s for r in results["async"].values())
        published = ", ".join(f"{k} {v:.2f}x" for k, v in PUBLISHED.items())
        lines.append(
            f"\n  best async vs colocated sync: {best / results['colocated'].samples_per_s:.2f}x; "
            f"vs sync on the same split: {best / base.samples_per_s:.2f}x (published: {published})"
        )
    lines.append(
        "  eng.idle: share of engine time with nothing decoding; eng.occ: mean share of decode slots in use;"
        " trn.idle: share of trainer time neither training nor syncing weights"
    )
    return "\n".join(lines)


def as_dict(results: dict) -> dict:
    """JSON-able results (without the per-group staleness trace)."""

    def one(r: Optional[Result]):
        if r is None:
            return None
        d = {k: v for k, v in asdict(r).items() if k not in ("staleness", "update_end_s")}
        return {**d, "staleness_max": r.staleness_max, "staleness_mean": r.staleness_mean}

    return {
        "sync": one(results["sync"]),
        "colocated": one(results.get("colocated")),
        "async": {str(s): one(r) for s, r in results["async"].items()},
    }
