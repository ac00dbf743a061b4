"""End to end through Ray on CPU: `megarl train` with a TP2 actor in two gloo worker processes, the
vLLM CPU build as the colocated rollout engine (one per process), the tiny arithmetic task.

GRPO: losses finite, weights change, every update reaches the engines (policy version = step, and
the engine's sampling log-probs equal the actor's recomputation), metrics JSONL / TensorBoard /
rollout dumps / reward plot written. Resume: a second run killed (SIGKILL, whole process group)
inside step 3, after the step-2 checkpoint, is rerun with the same command; it resumes at step 3
and step 3's metrics equal the uninterrupted run's. PPO: GAE with a TP1×DP2 critic beside the TP2
actor, a reference for the KL penalty, critic warm-up.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from train_helpers import HERE, REPO, overrides, run_train, train_command

from megarl.rollout import vllm_available
from megarl.testing.processes import TAG_VAR, kill_tagged, wait_until_gone
from megarl.trainer.metrics import read_metrics

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (CPU build) is not installed")

# temperature 0.7: the engines' sampling log-probs and the actor's old log-probs are both taken at the
# sampling temperature (one temperature contract), so their gap is ~0 at any temperature
GRPO = [
    "actor.layout.tp=2",  # a full run whose syncs gather TP shards (the quickstart itself is DP2)
    "trainer.total_steps=3",
    "trainer.checkpoint_every_steps=2",
    "validation.every_steps=2",
    f"reward.reward_fn={HERE / 'crash_reward.py'}:reward",
    "reward.timeout_s=30",
    "rollout.temperature=0.7",
]
NOT_COMPARED = ("time/", "perf/")


def step_rows(run_dir):
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if "reward/score/mean" in m]


@pytest.fixture(scope="module")
def grpo_run(tiny_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    code, out, seconds = run_train("grpo_quickstart.yaml", overrides(tiny_task, root / "run_a", *GRPO))
    assert code == 0, out[-4000:]
    print(f"GRPO run: {seconds:.0f} s")
    return root


def test_grpo_tp2_actor_with_vllm_trains_and_feeds_every_update_to_the_engines(grpo_run, tiny_task):
    run = grpo_run / "run_a"
    rows = step_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "advantages/mean"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert r["actor/update_ok"] == 1.0
    assert [r["rollout/policy_version"] for r in rows] == [1, 2, 3]  # each engine took each update
    # the engines sample with exactly the weights the actor recomputes log-probs with (after updates), and
    # both take log-probs at the sampling temperature (0.7 here)
    assert all(r["rollout/mismatch_abs_max"] < 1e-4 for r in rows), [r["rollout/mismatch_abs_max"] for r in rows]
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    assert _weights_changed(tiny_task["model"], run / "hf")
    metrics = read_metrics(run / "metrics.jsonl")
    assert metrics[0]["step"] == 0 and "val/score" in metrics[0]  # baseline before training
    assert "val/score" in rows[1] and "val/score" in rows[2]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "reward_curve.png").stat().st_size > 0 and (run / "config.yaml").is_file()
    dump = [json.loads(line) for line in (run / "rollouts" / "step_000003.jsonl").read_text().splitlines()]
    assert len(dump) == 16 and {"prompt", "response", "score", "advantage"} <= set(dump[0])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def _weights_changed(before_dir, after_dir) -> bool:
    from safetensors.torch import load_file

    before = load_file(f"{before_dir}/model.safetensors")
    after = {k: v for f in after_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(after) == set(before)
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_killed_after_checkpoint_resumes_at_next_step_with_equal_metrics(grpo_run, tiny_task):
    root = grpo_run
    armed = root / "armed"
    armed.touch()
    env = {**os.environ, "MEGARL_TEST_CRASH_ARMED": str(armed)}
    command = train_command("grpo_quickstart.yaml", overrides(tiny_task, root / "run_b", *GRPO))
    with open(root / "run_b.log", "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        _kill_when_blocked(proc, armed)
    assert (root / "run_b/checkpoints/step_000002/driver_state.pt").is_file()
    assert not (root / "run_b/checkpoints/step_000003").exists()
    armed.unlink()
    code, out, _ = run_train(
        "grpo_quickstart.yaml", overrides(tiny_task, root / "run_b", *GRPO), env={"MEGARL_TEST_CRASH_ARMED": str(armed)}
    )
    assert code == 0, out[-4000:]
    assert "resumed from" in out and "(step 2)" in out
    resumed, uninterrupted = step_rows(root / "run_b"), step_rows(root / "run_a")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    compared = {k: v for k, v in uninterrupted[2].items() if not k.startswith(NOT_COMPARED)}
    assert {k: resumed[2][k] for k in compared} == pytest.approx(compared, rel=1e-5, abs=1e-6)


def _kill_when_blocked(proc, armed, timeout=300):
    """SIGKILL the run's whole process group once the reward reports it is inside step 3."""
    deadline = time.time() + timeout
    blocked = armed.with_name(armed.name + ".blocked")
    while not blocked.exists():
        assert proc.poll() is None, "the run ended before reaching step 3"
        assert time.time() < deadline, "the run did not reach step 3 in time"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_ppo_gae_with_critic_tp1_dp2_beside_tp2_actor_and_critic_warmup(tiny_task, tmp_path):
    args = overrides(
        tiny_task,
        tmp_path / "ppo",
        "trainer.total_steps=3",
        "algorithm.critic_warmup_steps=1",
        "trainer.checkpoint_every_steps=0",
        "trainer.export_hf_at_end=false",
        "validation.every_steps=0",
        "validation.before_train=false",
        "critic.optim.warmup_steps=0",
    )
    code, out, seconds = run_train("ppo_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    print(f"PPO run: {seconds:.0f} s")
    rows = step_rows(tmp_path / "ppo")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "actor/loss" not in rows[0] and "rollout/policy_version" not in rows[0]  # critic warm-up
    assert [r["rollout/policy_version"] for r in rows[1:]] == [1, 2]
    for r in rows:
        for key in ("critic/loss", "critic/grad_norm", "values/mean", "returns/mean", "actor/kl_coef"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
    assert all(torch.isfinite(torch.tensor(r["actor/loss"])) for r in rows[1:])
    assert (tmp_path / "ppo/checkpoints/step_000003/critic").is_dir()
    assert list((tmp_path / "ppo" / "tensorboard").glob("events.out.tfevents.*"))


def test_grpo_with_a_vllm_engine_server_and_dynamic_sampling(tiny_task, tmp_path):
    """rollout.mode=server: one vLLM server on pool 'rollout', a TP1×DP2 actor on 'main' (only the
    replica of rank 0 gathers; rank 0 broadcasts over a gloo weight group). DAPO dynamic sampling
    with a reward that leaves some groups without variance: every trained group has it."""
    args = overrides(
        tiny_task,
        tmp_path / "server",
        "trainer.total_steps=2",
        "trainer.checkpoint_every_steps=0",
        "trainer.export_hf_at_end=false",
        "validation.before_train=false",
        "validation.every_steps=0",
        "resources.gpus_per_node=3",
        "resources.pools={main: 2, rollout: 1}",
        "rollout.mode=server",
        "rollout.pool=rollout",
        "actor.layout.tp=1",
        "algorithm.dapo.filter_groups=true",
        f"reward.reward_fn={HERE / 'hash_reward.py'}:reward",
        "trainer.dump_rollouts_every_steps=1",
    )
    code, out, seconds = run_train("grpo_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    rows = step_rows(tmp_path / "server")
    print(f"server-mode run: {seconds:.0f} s, generation rounds {[r['rollout/generation_rounds'] for r in rows]}")
    assert [r["rollout/policy_version"] for r in rows] == [1, 2]
    # the server samples with exactly the weights the actor recomputes log-probs with
    assert all(r["rollout/mismatch_abs_max"] < 1e-4 for r in rows), [r["rollout/mismatch_abs_max"] for r in rows]
    assert all(torch.isfinite(torch.tensor(r["actor/loss"])) for r in rows)
    assert all(0 <= r["rollout/score_before_filter"] <= 1 and r["rollout/generation_rounds"] >= 1 for r in rows)
    for step in (1, 2):
        dump = [
            json.loads(line) for line in (tmp_path / f"server/rollouts/step_00000{step}.jsonl").read_text().splitlines()
        ]
        groups: dict = {}
        for record in dump:
            groups.setdefault(record["uid"], set()).add(record["score"])
        assert len(dump) == 16 and len(groups) == 4 and all(len(s) > 1 for s in groups.values()), groups


@pytest.mark.parametrize("sigint", ["default", "inherited-ignored"])
def test_ctrl_c_stops_the_run_and_names_the_checkpoint_a_rerun_continues_from(tiny_task, tmp_path, sigint):
    """SIGINT to the run's process group (what a terminal's Ctrl-C sends) after the step-1 checkpoint, with
    SIGINT at its default and inherited ignored (`megarl train ... &` in a script): the run stops its
    workers within 10 s, names the checkpoint, exits 130, and no process of the run is left."""
    run, tag = tmp_path / "interrupted", f"ctrl-c-{sigint}-{os.getpid()}"
    args = overrides(
        tiny_task,
        run,
        "trainer.total_steps=200",
        "trainer.checkpoint_every_steps=1",
        "validation.before_train=false",
        "trainer.export_hf_at_end=false",
    )
    ignore = sigint == "inherited-ignored"
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            train_command("grpo_quickstart.yaml", args),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, TAG_VAR: tag},
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None,
        )
        deadline = time.time() + 400
        while not (run / "checkpoints/step_000001/driver_state.pt").exists():
            assert proc.poll() is None and time.time() < deadline, "the run did not reach its first checkpoint"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        start = time.perf_counter()
        code = proc.wait(timeout=60)
        seconds = time.perf_counter() - start
    out = (tmp_path / "log").read_text()
    left = wait_until_gone(tag, timeout_s=30)
    kill_tagged(tag)
    print(f"Ctrl-C ({sigint}): exited {code} after {seconds:.1f} s")
    assert code == 130, out[-3000:]
    assert "interrupted: stopping the workers" in out and "checkpoints/step_00000" in out
    assert "[megarl] stopped: workers and Ray gone" in out
    assert "Traceback" not in out and seconds < 10, (seconds, out[-3000:])
    assert not left, f"processes of the run outlived it: {left}"
