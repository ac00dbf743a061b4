"""The discrete-event model of the sync and async schedules (`megarl simulate`): pure Python, seconds.

At max_staleness=0 the async schedule is the sync one event for event; with pacing and partial rollouts
it is never slower than sync; no trained group is older than max_staleness in any mode; calibration from
a synthetic metrics.jsonl recovers the constants that made it; the command prints and refuses bad input.
"""

import json
import math
import random

import pytest
import yaml

from megarl.cli import main
from megarl.utils.simulate import Async, Costs, Decode, Layout, Lengths, SimConfig, simulate_async, simulate_sync
from megarl.utils.simulate.calibrate import calibrate
from megarl.utils.simulate.engine import SimEngine


def _random_config(rng: random.Random, seed: int) -> SimConfig:
    return SimConfig(
        layout=Layout(rollout_gpus=rng.choice([1, 2, 3, 4]), max_seqs_per_engine=rng.choice([2, 4, 8, 32])),
        lengths=Lengths(
            median=rng.choice([20, 50, 200]),
            sigma=rng.choice([0.0, 0.5, 1.0, 1.5]),
            max_tokens=rng.choice([64, 256, 2048]),
        ),
        decode=Decode(rng.choice([0.001, 0.01]), rng.choice([0.0, 0.0005, 0.005])),
        costs=Costs(rng.choice([0.0, 0.001, 0.05, 0.5]), rng.choice([0.0, 0.1, 2.0])),
        prompts_per_step=rng.choice([1, 2, 4]),
        samples_per_prompt=rng.choice([1, 2, 4]),
        steps=8,
        warmup_steps=1,
        seed=seed,
    )


CONFIGS = [_random_config(random.Random(i), i) for i in range(24)]


def test_one_engine_decodes_a_batch_in_base_times_longest_plus_per_seq_times_all_tokens():
    """The law calibration inverts: with every sequence in a slot, time = base * max + per_seq * sum."""
    engine, lengths = SimEngine(Decode(base_s=0.01, per_seq_s=0.002), max_seqs=8), [5, 40, 17, 3, 40, 9]
    for i, tokens in enumerate(lengths):
        engine.submit(0.0, i, tokens)
    finished, t = [], 0.0
    while (nxt := engine.next_finish()) is not None:
        finished += engine.finish(nxt)
        t = nxt
    assert sorted(finished) == list(range(len(lengths)))
    assert t == pytest.approx(0.01 * max(lengths) + 0.002 * sum(lengths), rel=1e-12)
    assert engine.busy_s == pytest.approx(t)


@pytest.mark.parametrize("index", range(0, 24, 3))
def test_async_at_staleness_0_is_the_sync_schedule_event_for_event(index):
    cfg = CONFIGS[index]
    sync, async0 = simulate_sync(cfg), simulate_async(cfg, Async(max_staleness=0))
    assert async0.update_end_s == pytest.approx(sync.update_end_s, rel=1e-12, abs=1e-12)
    assert async0.engine_idle_share == pytest.approx(sync.engine_idle_share, abs=1e-9)
    assert async0.trainer_idle_share == pytest.approx(sync.trainer_idle_share, abs=1e-9)
    assert async0.staleness_max == 0 and async0.dropped_groups == 0


def test_async_with_pacing_and_partial_rollouts_is_never_slower_than_sync():
    ratios = []
    for cfg in CONFIGS:
        sync = simulate_sync(cfg)
        for staleness in (1, 2, 3):
            ratios.append(simulate_async(cfg, Async(max_staleness=staleness)).samples_per_s / sync.samples_per_s)
    assert min(ratios) >= 1 - 1e-9, min(ratios)
    assert max(ratios) > 1.5  # and the overlap is worth something on long tails


def test_a_long_tail_leaves_sync_engines_idle_and_async_fills_them():
    cfg = SimConfig(
        layout=Layout(rollout_gpus=4, max_seqs_per_engine=64),
        lengths=Lengths(500, 1.2, 8192),
        decode=Decode(0.007, 0.0001),
        costs=Costs(0.02, 2.0),
        prompts_per_step=16,
        steps=10,
    )
    sync, fast = simulate_sync(cfg), simulate_async(cfg, Async(max_staleness=2))
    assert fast.samples_per_s > 1.5 * sync.samples_per_s
    assert fast.occupancy > 1.5 * sync.occupancy and fast.trainer_idle_share < sync.trainer_idle_share


@pytest.mark.parametrize(
    "over_stale,on_update", [("pace", "continue"), ("pace", "abort"), ("drop", "continue"), ("drop", "abort")]
)
def test_no_trained_group_is_older_than_max_staleness(over_stale, on_update):
    for cfg in CONFIGS[::2]:
        for staleness in (0, 1, 3):
            result = simulate_async(cfg, Async(max_staleness=staleness, over_stale=over_stale, on_update=on_update))
            assert len(result.staleness) == cfg.steps * cfg.prompts_per_step  # a full batch per update
            assert all(0 <= s <= staleness for _, s in result.staleness), (staleness, result.staleness_max)
            if over_stale == "pace":
                assert result.dropped_groups == 0
    lagging = simulate_async(CONFIGS[3], Async(max_staleness=2))
    assert lagging.staleness_max == 2  # the bound is reached, not just respected trivially


def _synthetic_run(tmp_path, decode: Decode, costs: Costs, lengths: Lengths, prompts: int, n: int, steps: int = 12):
    """metrics.jsonl + config.yaml of a sync run on one engine whose constants are the given ones."""
    rng, rows = random.Random(5), []
    for step in range(1, steps + 1):
        batch = [lengths.draw(rng) for _ in range(prompts * n)]
        generate = decode.base_s * max(batch) + decode.per_seq_s * sum(batch)
        rows.append(
            {
                "step": step,
                "time/generate": generate,
                "time/weight_sync": costs.weight_sync_s,
                "time/step": generate + len(batch) * costs.train_s_per_sample + costs.weight_sync_s,
                "response_length/mean": sum(batch) / len(batch),
                "response_length/max": max(batch),
                "response_length/clip_ratio": sum(b >= lengths.max_tokens for b in batch) / len(batch),
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "torn')
    config = {
        "trainer": {"prompts_per_step": prompts},
        "resources": {"nodes": 1, "gpus_per_node": 3, "pools": {"main": 2, "rollout": 1}},
        "rollout": {
            "samples_per_prompt": n,
            "max_response_tokens": lengths.max_tokens,
            "mode": "server",
            "pool": "rollout",
            "tp": 1,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("lengths", [Lengths(median=60, sigma=0.8, max_tokens=1000), Lengths(300, 1.0, 512)])
def test_calibration_recovers_the_constants_of_a_synthetic_run(tmp_path, lengths):
    decode, costs = Decode(base_s=0.004, per_seq_s=0.0003), Costs(train_s_per_sample=0.05, weight_sync_s=0.7)
    _synthetic_run(tmp_path, decode, costs, lengths, prompts=4, n=8)
    cfg = calibrate(tmp_path, max_seqs=64)
    assert (cfg.layout.engines, cfg.prompts_per_step, cfg.samples_per_prompt) == (1, 4, 8)
    assert cfg.decode.base_s == pytest.approx(decode.base_s, rel=1e-6)
    assert cfg.decode.per_seq_s == pytest.approx(decode.per_seq_s, rel=1e-6)
    assert cfg.costs.train_s_per_sample == pytest.approx(costs.train_s_per_sample, rel=1e-9)
    assert cfg.costs.weight_sync_s == pytest.approx(costs.weight_sync_s, rel=1e-9)
    assert cfg.lengths.max_tokens == lengths.max_tokens
    assert cfg.lengths.median == pytest.approx(lengths.median, rel=0.25)
    assert cfg.lengths.sigma == pytest.approx(lengths.sigma, abs=0.25)


def test_the_command_prints_sync_and_async_and_refuses_bad_input(tmp_path, capsys):
    args = [
        "simulate",
        "--rollout-gpus",
        "2",
        "--max-seqs",
        "16",
        "--length-median",
        "50",
        "--max-tokens",
        "400",
        "--steps",
        "6",
        "--warmup-steps",
        "1",
        "--max-staleness",
        "0",
        "2",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["async"]["0"]["samples_per_s"] == pytest.approx(out["sync"]["samples_per_s"])
    assert out["async"]["2"]["samples_per_s"] > out["sync"]["samples_per_s"] and out["async"]["2"]["staleness_max"] <= 2
    assert main(args[:-1]) == 0 and "async, max_staleness=2" in capsys.readouterr().out
    assert main(["simulate", "--max-staleness", "-1"]) == 2
    assert "--max-staleness [-1]: each must be >= 0" in capsys.readouterr().err
    assert main(["simulate", "--calibrate", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl there" in capsys.readouterr().err
    assert main(["simulate", "--rollout-gpus", "1", "--engine-tp", "2"]) == 2
    assert "no engine fits" in capsys.readouterr().err


def test_a_calibrated_model_predicts_the_run_it_was_fitted_to(tmp_path, capsys):
    lengths = Lengths(median=80, sigma=0.6, max_tokens=2000)
    _synthetic_run(tmp_path, Decode(0.004, 0.0003), Costs(0.05, 0.7), lengths, prompts=4, n=8)
    assert main(["simulate", "--calibrate", str(tmp_path), "--steps", "12", "--max-staleness", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sync"]["samples_per_s"] == pytest.approx(out["measured_sync_samples_per_s"], rel=0.1)
    assert math.isfinite(out["async"]["1"]["samples_per_s"])
