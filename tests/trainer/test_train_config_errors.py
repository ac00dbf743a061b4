"""`megarl train` refuses bad configs in about a second, naming the field, before Ray or any worker."""

import sys
import time

import pytest
from train_helpers import REPO, overrides

from megarl import cli

BAD = [
    (["actor.layout.tp=1", "trainer.prompts_per_step=3", "rollout.samples_per_prompt=1"], "trainer.prompts_per_step"),
    (["resources.gpus_per_node=4", "actor.layout.tp=4"], "actor.layout"),
    (["algorithm.advantage.estimator=gea"], "algorithm.advantage.estimator"),
    (["data.files=[/nonexistent/train.parquet]"], "data.files"),
    (["algorithm.advantage.estimator=gae"], "critic.enabled"),
]


@pytest.mark.parametrize(
    "bad,field", BAD, ids=["indivisible", "tp-over-heads", "unknown-estimator", "missing-data", "gae-without-critic"]
)
def test_bad_config_fails_fast_naming_the_field_before_any_worker(tiny_task, tmp_path, capsys, bad, field):
    args = [
        "train",
        "--config",
        str(REPO / "configs/grpo_quickstart.yaml"),
        *overrides(tiny_task, tmp_path / "run", *bad),
    ]
    start = time.perf_counter()
    assert cli.main(args) == 2
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert err.startswith("megarl train: error:") and field in err, err
    assert seconds < 5, seconds
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written
