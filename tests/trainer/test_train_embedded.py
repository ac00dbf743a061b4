"""End to end through Ray with the embedded (transformers) rollout engine: runs without vLLM.

ReMax: the advantage estimator declares it needs the greedy baseline, so the loop generates each
prompt's greedy response and scores it; every sample's advantage is its score minus that baseline.
Asynchronous checkpoints: complete once written, a resume from one equals the uninterrupted run, and a run
killed while one is written resumes from the one before.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from train_helpers import HERE, REPO, overrides, run_train, train_command

from megarl.testing.processes import TAG_VAR, kill_tagged, wait_until_gone
from megarl.trainer import state
from megarl.trainer.metrics import read_metrics


def test_remax_generates_greedy_baselines_and_trains_on_score_minus_baseline(tiny_task, tmp_path):
    run = tmp_path / "remax"
    args = overrides(
        tiny_task,
        run,
        "rollout.engine=embedded",
        "algorithm.advantage.estimator=remax",
        "trainer.total_steps=2",
        "trainer.checkpoint_every_steps=0",
        "trainer.export_hf_at_end=false",
        "validation.before_train=false",
        "validation.every_steps=0",
        "trainer.dump_rollouts_every_steps=1",
    )
    code, out, seconds = run_train("grpo_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    print(f"ReMax run (embedded engine): {seconds:.0f} s")
    rows = [m for m in read_metrics(run / "metrics.jsonl") if "reward/score/mean" in m]
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/policy_version"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/baseline/mean"] <= 1.0 and torch.isfinite(torch.tensor(r["actor/loss"]))
    for step in (1, 2):
        records = [json.loads(line) for line in (run / f"rollouts/step_00000{step}.jsonl").read_text().splitlines()]
        assert len(records) == 16
        for record in records:  # reward-to-go on every token is the score: A = score − greedy baseline
            assert abs(record["advantage"] - (record["score"] - record["baseline_score"])) < 1e-5, record
        by_prompt: dict = {}
        for record in records:
            by_prompt.setdefault(record["uid"], set()).add(record["baseline_score"])
        assert all(len(b) == 1 for b in by_prompt.values())  # one greedy baseline per prompt


def test_batch_reward_overlaps_log_probs_logs_its_keys_and_val_only_evaluates_the_checkpoint(tiny_task, tmp_path):
    """A batch-level reward fn (judge_reward.judge, 2 s per call) runs on the reward thread while the
    log-prob phase runs; its extra keys are logged overall and per data source; validation samples on its
    own (temperature 0.7, n=2: mean@2 / pass@2); then trainer.val_only=true evaluates the final checkpoint
    without training and appends that validation to metrics.jsonl."""

    run, log = tmp_path / "judge", tmp_path / "judge.log"
    args = overrides(
        tiny_task,
        run,
        "rollout.engine=embedded",
        f"reward.batch_reward_fn={HERE / 'judge_reward.py'}:judge",
        "reward.num_workers=0",
        # two epochs: the update is not the step's only one, so the old log-probs get their own forward
        # (one update would take them from its own forward: no log-prob phase for the reward to hide behind)
        "actor.epochs_per_step=2",
        "trainer.total_steps=2",
        "trainer.checkpoint_every_steps=0",
        "trainer.export_hf_at_end=false",
        "validation.before_train=false",
        "validation.every_steps=0",
        "validation.greedy=false",
        "validation.temperature=0.7",
        "validation.samples_per_prompt=2",
        "trainer.dump_rollouts_every_steps=0",
    )
    code, out, seconds = run_train("grpo_quickstart.yaml", args, env={"MEGARL_TEST_JUDGE_LOG": str(log)})
    assert code == 0, out[-4000:]
    print(f"batch-reward run (embedded engine): {seconds:.0f} s")
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "reward/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/error_rate"] == 0.0, r  # the judge ran, no sample fell back to failure_score
        assert r["reward/judged"] == 1.0 and r["reward/arithmetic/judged"] == 1.0 and 0 <= r["reward/format"] <= 1
        assert r["reward/arithmetic/score"] == r["reward/score/mean"]
        # the judge ran while the driver computed the old log-probs (on a fast machine that phase is ~16 ms,
        # less than the judge's own start and the scoring after it: its time cannot show the overlap)
        assert r["reward/overlapped"] == 1.0, r
    val = rows[-1]
    assert val["step"] == 2 and 0 <= val["val/acc/mean@2"] <= val["val/acc/pass@2"] <= 1
    assert val["val/arithmetic/acc"] == val["val/acc"] and val["val/arithmetic/judged"] == 1.0
    calls = log.read_text().split()
    assert calls[0::3] == ["megarl-reward_0", "megarl-reward_0", "MainThread"] and calls[1::3] == ["16", "16", "16"]
    # the start-up's objects stay out of the driver's collections while it trains (a full one walked them all)
    assert min(int(n) for n in calls[2::3]) > 100_000, calls

    code, out, _ = run_train(
        "grpo_quickstart.yaml",
        [*args, "trainer.val_only=true", "validation.greedy=true", "validation.samples_per_prompt=1"],
    )
    assert code == 0, out[-4000:]
    after = read_metrics(run / "metrics.jsonl")
    assert after[: len(rows)] == rows and len(after) == len(rows) + 1  # appended, nothing trained or dropped
    assert after[-1]["step"] == 2 and "val/acc" in after[-1] and not any("reward/score/mean" in r for r in after[-1:])
    assert "resumed from" in out


def async_checkpoint_args(task, run_dir, steps: int, *extra: str) -> list[str]:
    """A `steps`-step run on the embedded engine with an asynchronous checkpoint after every step."""
    return overrides(
        task,
        run_dir,
        "rollout.engine=embedded",
        "trainer.checkpoint_async=true",
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every_steps=1",
        "trainer.export_hf_at_end=false",
        "validation.before_train=false",
        "validation.every_steps=0",
        *extra,
    )


def test_asynchronous_checkpoints_count_once_written_and_a_resume_from_one_equals_the_uninterrupted_run(
    tiny_task, tmp_path
):
    """trainer.checkpoint_async=true (with the DP-sharded optimizer format): every step's checkpoint is
    complete (driver state and manifest) once the run ends, older ones pruned as usual; a run stopped after 2
    steps and continued to 3 from its last asynchronous checkpoint gives step 3 the metrics of a run that went
    straight to 3."""

    def run(name: str, steps: int):
        args = async_checkpoint_args(
            tiny_task,
            tmp_path / name,
            steps,
            "trainer.checkpoint_reshardable=false",  # the optimizer state DP-sharded: the fast format
            "trainer.keep_checkpoints=2",
        )
        code, out, _ = run_train("grpo_quickstart.yaml", args)
        assert code == 0, out[-4000:]
        return out

    run("straight", 3)
    run("resumed", 2)
    out = run("resumed", 3)
    assert "resumed from" in out and "(step 2)" in out
    for name in ("straight", "resumed"):
        kept = state.complete_checkpoints(tmp_path / name)
        assert [step for step, _ in kept] == [2, 3]
        assert all(state.checkpoint_problem(path) is None for _, path in kept)
    straight, resumed = (
        [m for m in read_metrics(tmp_path / name / "metrics.jsonl") if "reward/score/mean" in m]
        for name in ("straight", "resumed")
    )
    assert [r["step"] for r in resumed] == [1, 2, 3]
    compared = {k: v for k, v in straight[2].items() if not k.startswith(("time/", "perf/"))}
    assert {k: resumed[2][k] for k in compared} == pytest.approx(compared, rel=1e-5, abs=1e-6)


def test_a_run_killed_while_an_asynchronous_checkpoint_is_written_resumes_from_the_one_before(tiny_task, tmp_path):
    """SIGKILL while step 2's asynchronous checkpoint is being written (its writing threads held, training going
    on): nothing of step 2 looks complete (no driver state, its engine part unpublished), and the same command
    resumes from step 1 and completes its steps with complete checkpoints."""
    run, held, tag = tmp_path / "run", tmp_path / "held", f"async-ckpt-{os.getpid()}"
    args = async_checkpoint_args(tiny_task, run, 3)
    hold = {"MEGARL_FAULT_HOLD": "checkpoint.write@2", "MEGARL_FAULT_HOLD_FILE": str(held), TAG_VAR: tag}
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            train_command("grpo_quickstart.yaml", args),
            cwd=REPO,
            env={**os.environ, **hold},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 300
        while not held.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kill_tagged(tag)
    wait_until_gone(tag, timeout_s=30)
    step2 = state.step_dir(run, 2)
    assert [step for step, _ in state.complete_checkpoints(run)] == [1]
    assert not (step2 / state.DRIVER_STATE).exists() and not (step2 / "actor").exists()
    code, out, _ = run_train("grpo_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    assert "resumed from" in out and "(step 1)" in out
    kept = state.complete_checkpoints(run)
    assert [step for step, _ in kept] == [2, 3] and all(state.checkpoint_problem(p) is None for _, p in kept)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward/score/mean" in r] == [1, 2, 3]
