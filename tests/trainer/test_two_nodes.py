"""Two real Ray nodes on one machine (network namespaces joined by a veth pair; megarl.testing.netns):
a GRPO run with the actor on one node and its engine server on the other (one CPU per node, one
worker per pool: the pools cannot share a node), so every weight broadcast crosses the link. The
worker node is killed mid-run: the driver stops with one line naming the lost node and the
checkpoint a rerun continues from; the node comes back and the rerun resumes and matches the
uninterrupted run. Skipped, with the reason, where network namespaces are unavailable."""

import subprocess
import sys

import pytest
from train_helpers import HERE, train_command

from megarl.testing.netns import TwoNodes, netns_unavailable
from megarl.trainer.metrics import read_metrics

UNAVAILABLE = netns_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"two namespaced Ray nodes: {UNAVAILABLE}")
NOT_COMPARED = ("time/", "perf/")


def two_node_args(task, run_dir, address):
    return [
        f"model.hf_path={task['model']}",
        f"data.files=[{task['train']}]",
        "validation.files=[]",
        "data.apply_chat_template=false",
        "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "trainer.progress_bar=false",
        f"trainer.run_dir={run_dir}",
        "actor.optim.lr=1e-3",
        "actor.optim.warmup_steps=0",
        "rollout.engine=embedded",
        f"resources.ray_address={address}",
        "resources.nodes=2",
        "resources.gpus_per_node=1",
        "resources.pools={main: 1, rollout: 1}",
        "rollout.mode=server",
        "rollout.pool=rollout",
        "actor.layout.tp=1",
        "trainer.total_steps=3",
        "trainer.checkpoint_every_steps=1",
        "trainer.export_hf_at_end=false",
        "trainer.dump_rollouts_every_steps=0",
        "trainer.loggers=[console,jsonl]",
        f"reward.reward_fn={HERE / 'gate_reward.py'}:reward",
        "reward.timeout_s=300",
    ]


def train(nodes, task, run_dir, log, env=None):
    return nodes.popen(train_command("grpo_quickstart.yaml", two_node_args(task, run_dir, nodes.address)), log, env)


def actor_nodes(nodes) -> dict[str, str]:
    """{actor class: node IP} of the cluster's live actors (Ray's actor table, from the head namespace)."""
    probe = (
        "import ray, sys; from ray._private import state; ray.init(address=sys.argv[1], log_to_driver=False);"
        " [print(a['ActorClassName'].split('.')[-1], a['Address']['IPAddress'])"
        "  for a in state.actors().values() if a['State'] == 'ALIVE']"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", nodes.head_ns, sys.executable, "-c", probe, nodes.address],
        capture_output=True,
        text=True,
        env=nodes.env,
        timeout=120,
    )
    return dict(line.split() for line in out.stdout.splitlines() if line.count(" ") == 1)


def wait_for(path, proc, timeout_s=300):
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the run did not write {path}"
        time.sleep(0.2)


def step_rows(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/score/mean" in r]


def test_losing_a_node_mid_run_names_it_and_the_rerun_on_the_restored_cluster_matches(tiny_task, tmp_path):
    with TwoNodes(tmp_path) as nodes:
        nodes.start()
        whole = train(nodes, tiny_task, tmp_path / "whole", tmp_path / "whole.log")
        assert whole.wait(timeout=600) == 0, (tmp_path / "whole.log").read_text()[-3000:]

        gate = tmp_path / "gate"  # holds the cut run's reward inside step 3, after the step-2 checkpoint
        gate.touch()
        after = tmp_path / "cut/checkpoints/step_000002/driver_state.pt"
        cut = train(
            nodes,
            tiny_task,
            tmp_path / "cut",
            tmp_path / "cut.log",
            {"MEGARL_TEST_GATE": str(gate), "MEGARL_TEST_GATE_AFTER": str(after)},
        )
        wait_for(tmp_path / "cut/checkpoints/step_000001/driver_state.pt", cut)
        placed = actor_nodes(nodes)
        assert {placed.get("WorkerHost"), placed.get("EngineServer")} == {nodes.head_ip, nodes.worker_ip}, placed
        wait_for(tmp_path / "gate.waiting", cut)
        nodes.kill_worker()
        gate.unlink()
        assert cut.wait(timeout=180) == 1
        err = (tmp_path / "cut.log").read_text()
        assert f"megarl train: error: lost Ray node {nodes.worker_ip}" in err, err[-3000:]
        assert "rerunning the same command continues from the latest complete checkpoint" in err
        assert "Traceback" not in err

        nodes.start_worker()
        nodes.wait_started("worker")
        rerun = train(nodes, tiny_task, tmp_path / "cut", tmp_path / "rerun.log")
        assert rerun.wait(timeout=600) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    out = (tmp_path / "rerun.log").read_text()
    assert "resumed from" in out and "(step 2)" in out, out[-3000:]
    resumed, uninterrupted = step_rows(tmp_path / "cut"), step_rows(tmp_path / "whole")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == [1, 2, 3]
    assert all(r["rollout/policy_version"] == r["step"] for r in resumed)  # every broadcast reached the server
    compared = {k: v for k, v in uninterrupted[2].items() if not k.startswith(NOT_COMPARED)}
    assert {k: resumed[2][k] for k in compared} == pytest.approx(compared, rel=1e-5, abs=1e-6)
