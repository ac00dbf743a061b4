"""End to end through Ray with the embedded (transformers) rollout engine: runs without vLLM.

ReMax: the advantage estimator declares it needs the greedy baseline, so the loop generates each
prompt's greedy response and scores it; every sample's advantage is its score minus that baseline.
"""
import json

import torch

from megarl.trainer.metrics import read_metrics
from train_helpers import overrides, run_train


def test_remax_generates_greedy_baselines_and_trains_on_score_minus_baseline(tiny_task, tmp_path):
    run = tmp_path / "remax"
    args = overrides(tiny_task, run, "rollout.engine=embedded", "algorithm.advantage.estimator=remax",
                     "trainer.total_steps=2", "trainer.checkpoint_every_steps=0", "trainer.export_hf_at_end=false",
                     "validation.before_train=false", "validation.every_steps=0", "trainer.dump_rollouts_every_steps=1")
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
