"""trainer.mode=async end to end on CPU: one vLLM engine server on pool 'rollout', a TP1 actor on 'main'.

* max_staleness=0 is the synchronous run: the same metrics (all but timings) step for step.
* max_staleness=1 with on_update=continue and a checkpoint every 2 steps, SIGKILLed while it writes the
  step-4 checkpoint, then rerun from step 2 with on_update=abort and one more step: requests ran across weight updates (per-token versions show
  the switch under continue; under abort the router reran the aborted ones and no sample is short),
  no trained token lags more than one version, and every prompt group is trained exactly once across
  the two runs, the rerun starting with the groups buffered or in flight at the checkpoint.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from train_helpers import REPO, overrides, run_train, train_command

from megarl.rollout import vllm_available
from megarl.testing.processes import TAG_VAR, kill_tagged, wait_until_gone
from megarl.trainer.metrics import read_metrics

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (CPU build) is not installed")

SERVER = [
    "resources.gpus_per_node=2",
    "resources.pools={main: 1, rollout: 1}",
    "rollout.mode=server",
    "rollout.pool=rollout",
    "actor.layout.tp=1",
    "trainer.loggers=[jsonl]",
    "validation.before_train=false",
    "validation.every_steps=0",
    "trainer.export_hf_at_end=false",
    "trainer.dump_rollouts_every_steps=1",
]
TIMINGS = ("time/", "perf/")


def step_rows(run_dir):
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if "reward/score/mean" in m]


def dumped_uids(run_dir, step):
    return [json.loads(line)["uid"] for line in (run_dir / f"rollouts/step_{step:06d}.jsonl").read_text().splitlines()]


def test_async_with_staleness_0_gives_the_synchronous_run(tiny_task, tmp_path):
    common = [*SERVER, "trainer.total_steps=2", "trainer.checkpoint_every_steps=0", "rollout.temperature=0.7"]
    runs = {}
    for mode in ("sync", "async"):
        args = overrides(tiny_task, tmp_path / mode, *common, f"trainer.mode={mode}", "async_training.max_staleness=0")
        code, out, seconds = run_train("grpo_quickstart.yaml", args)
        assert code == 0, out[-4000:]
        print(f"{mode} run: {seconds:.0f} s")
        runs[mode] = step_rows(tmp_path / mode)
    assert [r["step"] for r in runs["async"]] == [1, 2]
    for sync, asynchronous in zip(runs["sync"], runs["async"]):
        compared = [k for k in sync if not k.startswith(TIMINGS)]
        assert len(compared) > 20 and set(compared) <= set(asynchronous)
        assert {k: sync[k] for k in compared} == {k: asynchronous[k] for k in compared}
        assert asynchronous["async/staleness_max"] == 0 and asynchronous["async/dropped"] == 0
        assert 0 <= asynchronous["time/trainer_idle_share"] <= 1 and 0 <= asynchronous["time/engine_idle_share"] <= 1
    for step in (1, 2):
        assert dumped_uids(tmp_path / "sync", step) == dumped_uids(tmp_path / "async", step)


def _killed_at_checkpoint(args, run_dir, hold_file, nth: int, timeout_s: float = 400) -> None:
    """Run until the driver writes the state of its `nth` checkpoint, then SIGKILL its process group."""
    tag = f"async-kill-{os.getpid()}"
    env = {
        **os.environ,
        TAG_VAR: tag,
        "MEGARL_FAULT_HOLD": f"checkpoint.driver_state@{nth}",
        "MEGARL_FAULT_HOLD_FILE": str(hold_file),
    }
    with open(run_dir.parent / "killed.log", "w") as log:
        proc = subprocess.Popen(
            train_command("grpo_quickstart.yaml", args),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        deadline = time.time() + timeout_s
        while not hold_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not wait_until_gone(tag, timeout_s=30)
    kill_tagged(tag)
    assert hold_file.exists(), (run_dir.parent / "killed.log").read_text()[-4000:]


def test_async_killed_mid_checkpoint_resumes_training_every_prompt_once(tiny_task, tmp_path):
    run = tmp_path / "run"
    args = overrides(
        tiny_task,
        run,
        *SERVER,
        "trainer.mode=async",
        "async_training.max_staleness=1",
        "async_training.on_update=continue",
        "trainer.checkpoint_every_steps=2",
        "trainer.keep_checkpoints=0",
        "rollout.max_response_tokens=200",
    )
    # no checkpoint between steps 1 and 2: the groups admitted after step 1 are still generating at the
    # update after step 2 (long responses), and step 3 trains them
    _killed_at_checkpoint([*args, "trainer.total_steps=4"], run, tmp_path / "held", nth=2)
    first = step_rows(run)  # steps 1-4 (step 4's checkpoint never completed)
    first_uids = {step: dumped_uids(run, step) for step in (1, 2)}
    cursor = torch.load(run / "checkpoints/step_000002/driver_state.pt", weights_only=False)["rollouts"]
    code, out, seconds = run_train(
        "grpo_quickstart.yaml", [*args, "trainer.total_steps=5", "async_training.on_update=abort"]
    )
    assert code == 0, out[-4000:]
    print(f"resumed run: {seconds:.0f} s")
    assert "resumed from" in out and "(step 2)" in out
    rows = step_rows(run)
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # under continue, requests in flight across the update after step 2 finished on the new weights
    assert first[2]["async/mixed_version_samples"] > 0, first[2]
    # under abort, the requests in flight at an update were aborted and run again: none comes back short
    assert rows[-1]["async/reruns"] > 0 and rows[-1]["async/mixed_version_samples"] == 0
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped"] == 0 for r in first + rows)
    # every prompt group trained once: steps 1-2 of the killed run, 3-5 of the rerun (its steps 3-4 were
    # lost with the step-4 checkpoint), which starts with
    # the groups the checkpoint had buffered or in flight
    trained = [dumped_uids(run, step) for step in range(1, 6)]
    assert trained[:2] == [first_uids[1], first_uids[2]]
    groups = [uid for step in trained for uid in sorted(set(step))]
    assert all(len(step) == 16 for step in trained) and len(groups) == len(set(groups)) == 20
    assert cursor["batch"] == 3 and cursor["pending"], cursor
    pending = {f"{k}.0:{r}" for k, r in cursor["pending"]}
    assert pending & set(trained[2]), (pending, trained[2])
