"""The `megarl simulate` command's arguments and what it does with them (the cli only registers it).

    megarl simulate --preset 7b-64gpu                         # the 7B / 64 H100 scenario (presets.py)
    megarl simulate --calibrate runs/my_sync_run              # constants fitted to a sync run's metrics.jsonl
    megarl simulate --calibrate RUN --rollout-gpus 32 --train-gpus 32 --max-seqs 128 --max-staleness 1 2 4
    megarl simulate --rollout-gpus 8 --length-median 2000 --length-sigma 1.2 --decode-base-ms 7 ...

Start from a preset, a calibration, or the defaults of `SimConfig`; every flag given overrides one field.
Pure Python; imports nothing from megarl outside this package.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from megarl.utils.simulate.calibrate import calibrate, measured_samples_per_s
from megarl.utils.simulate.model import Async, SimConfig
from megarl.utils.simulate.presets import PRESETS, preset
from megarl.utils.simulate.report import as_dict, compare, format_report

# flag -> (part of SimConfig, field, scale from the flag's unit to the field's)
_FIELDS = {
    "rollout_gpus": ("layout", "rollout_gpus", 1),
    "train_gpus": ("layout", "train_gpus", 1),
    "engine_tp": ("layout", "engine_tp", 1),
    "max_seqs": ("layout", "max_seqs_per_engine", 1),
    "length_median": ("lengths", "median", 1),
    "length_sigma": ("lengths", "sigma", 1),
    "max_tokens": ("lengths", "max_tokens", 1),
    "decode_base_ms": ("decode", "base_s", 1e-3),
    "decode_per_seq_ms": ("decode", "per_seq_s", 1e-3),
    "train_ms_per_sample": ("costs", "train_s_per_sample", 1e-3),
    "weight_sync_s": ("costs", "weight_sync_s", 1),
    "prompts_per_step": (None, "prompts_per_step", 1),
    "samples_per_prompt": (None, "samples_per_prompt", 1),
    "steps": (None, "steps", 1),
    "warmup_steps": (None, "warmup_steps", 1),
    "seed": (None, "seed", 1),
}
_HELP = {
    "rollout_gpus": "GPUs of the rollout engines",
    "train_gpus": "GPUs of the trainer (reported; speed is in --train-ms-per-sample)",
    "engine_tp": "GPUs per engine",
    "max_seqs": "sequences one engine decodes at once",
    "length_median": "lognormal response length median (tokens)",
    "length_sigma": "lognormal sigma (long tail)",
    "max_tokens": "response length cap",
    "decode_base_ms": "decode step time independent of the batch",
    "decode_per_seq_ms": "decode step time each running sequence adds",
    "train_ms_per_sample": "trainer work per sample (reward, log-probs, updates)",
    "weight_sync_s": "seconds per weight update (engines paused)",
    "prompts_per_step": "groups per update",
    "samples_per_prompt": "samples per group",
    "steps": "updates simulated",
    "warmup_steps": "leading updates left out of the throughput",
    "seed": "seed of the length draws",
}
_INTS = {
    "rollout_gpus",
    "train_gpus",
    "engine_tp",
    "max_seqs",
    "max_tokens",
    "prompts_per_step",
    "samples_per_prompt",
    "steps",
    "warmup_steps",
    "seed",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--preset", choices=sorted(PRESETS), help="start from a named scenario (see presets.py)")
    start.add_argument(
        "--calibrate", metavar="RUN_DIR", help="start from constants fitted to a sync run's metrics.jsonl"
    )
    for flag in _FIELDS:
        parser.add_argument(
            "--" + flag.replace("_", "-"), type=int if flag in _INTS else float, default=None, help=_HELP[flag]
        )
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2, 4], help="async schedules to simulate")
    parser.add_argument("--over-stale", choices=["pace", "drop"], default="pace")
    parser.add_argument("--on-update", choices=["continue", "abort"], default="continue")
    parser.add_argument("--max-concurrent-rollouts", type=int, default=None)
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="also the synchronous baseline with every GPU rolling out and training (on with --preset)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def build_config(args: argparse.Namespace) -> SimConfig:
    """The scenario: preset / calibration / defaults, then each flag given."""
    if args.preset:
        cfg = preset(args.preset)
    elif args.calibrate:
        cfg = calibrate(
            args.calibrate,
            max_seqs=args.max_seqs or 256,
            prompts_per_step=args.prompts_per_step,
            samples_per_prompt=args.samples_per_prompt,
        )
    else:
        cfg = SimConfig()
    parts, top = {}, {}
    for flag, (part, name, scale) in _FIELDS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        value = value * scale if scale != 1 else value
        if part is None:
            top[name] = value
        else:
            parts.setdefault(part, {})[name] = value
    parts = {part: replace(getattr(cfg, part), **fields) for part, fields in parts.items()}
    return replace(cfg, **parts, **top)


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    knobs = Async(
        over_stale=args.over_stale, on_update=args.on_update, max_concurrent_rollouts=args.max_concurrent_rollouts
    )
    if any(s < 0 for s in args.max_staleness):
        raise ValueError(f"--max-staleness {args.max_staleness}: each must be >= 0")
    results = compare(cfg, args.max_staleness, knobs, colocated=args.colocated or bool(args.preset))
    measured = measured_samples_per_s(args.calibrate, cfg.batch_samples) if args.calibrate else None
    if args.json:
        print(json.dumps({"scenario": cfg.name, "measured_sync_samples_per_s": measured, **as_dict(results)}, indent=1))
    else:
        print(format_report(cfg, results, knobs, measured))
    return 0
