"""Bad inputs a new user meets fail in seconds with one line naming the field or file and the fix,
before Ray or any worker starts, and leave an existing run directory exactly as it was.

`BAD_INPUTS` is the table: (id, how to build the bad input, expected fragment of the one-line error).
Each `make` gets the tiny task and a fresh tmp dir and returns the `megarl` arguments."""

import json
import shutil
import sys
import time

import pytest
import torch
from train_helpers import REPO, overrides

from megarl import cli
from megarl.trainer import state

QUICKSTART = str(REPO / "configs/grpo_quickstart.yaml")


def train_args(task, run_dir, *extra):
    return ["train", "--config", QUICKSTART, *overrides(task, run_dir, *extra)]


def previous_run(run_dir, steps=(1, 2), shard_bytes=300):
    """A run directory as an earlier run left it: config.yaml, metrics.jsonl, complete checkpoints."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("# the previous run's resolved config\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    for step in steps:
        directory = state.step_dir(run_dir, step)
        (directory / "actor").mkdir(parents=True)
        (directory / "actor/__0_0.distcp").write_bytes(b"x" * shard_bytes)
        state.save_driver_state(directory, state.DriverState(step, {"epoch": 0, "position": 4 * step}))
    return run_dir


def model_copy(task, tmp, damage):
    model = tmp / "model"
    shutil.copytree(task["model"], model)
    damage(model / "model.safetensors")
    return model


def no_weights(task, tmp):
    model = model_copy(task, tmp, lambda f: f.unlink())
    return train_args(task, previous_run(tmp / "run"), f"model.hf_path={model}")


def truncated_weights(task, tmp):
    model = model_copy(task, tmp, lambda f: f.write_bytes(f.read_bytes()[:5000]))
    return train_args(task, previous_run(tmp / "run"), f"model.hf_path={model}")


def resume_without_driver_state(task, tmp):
    run = previous_run(tmp / "run")
    (state.step_dir(run, 3) / "actor").mkdir(parents=True)  # a save that was killed
    return train_args(task, run, f"trainer.resume={state.step_dir(run, 3)}")


def resume_truncated_shard(task, tmp):
    run = previous_run(tmp / "run")
    shard = state.step_dir(run, 2) / "actor/__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return train_args(task, run, f"trainer.resume={state.step_dir(run, 2)}")


def resume_empty_driver_state(task, tmp):
    run = previous_run(tmp / "run")
    (state.step_dir(run, 2) / state.DRIVER_STATE).write_bytes(b"")
    return train_args(task, run, f"trainer.resume={state.step_dir(run, 2)}")


def resume_dp_sharded_at_another_layout(task, tmp):
    run = previous_run(tmp / "run")
    meta = {"layout": {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "ep": 1}, "optimizer_format": "dp_reshardable"}
    (state.step_dir(run, 2) / "actor/megarl_checkpoint.json").write_text(json.dumps(meta))
    return train_args(task, run)  # the quickstart's actor: TP1 (DP2)


def resume_past_total_steps(task, tmp):
    return train_args(task, previous_run(tmp / "run", steps=(4, 5)), "trainer.total_steps=3")


def unknown_data_source(task, tmp):
    data = tmp / "mystery.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "mystery"}) + "\n"
            for i in range(8)
        )
    )
    return train_args(task, previous_run(tmp / "run"), f"data.files=[{data}]", "validation.files=[]")


def gpu_without_gpus(task, tmp):
    gpus = 2 * (torch.cuda.device_count() // 2 + 1)
    return train_args(task, previous_run(tmp / "run"), "resources.accelerator=gpu", f"resources.gpus_per_node={gpus}")


def run_dir_is_a_file(task, tmp):
    (tmp / "run").write_text("not a directory")
    return train_args(task, tmp / "run")


def run_dir_under_a_file(task, tmp):
    (tmp / "file").write_text("not a directory")
    return train_args(task, tmp / "file" / "run")


def run_dir_not_writable(task, tmp):
    return train_args(task, "/sys")  # exists, and even root cannot create files in it


def non_utf8_jsonl(task, tmp):
    data = tmp / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "caf\xe9", "ground_truth": "2"}\n')
    return train_args(task, previous_run(tmp / "run"), f"data.files=[{data}]")


def garbage_parquet(task, tmp):
    data = tmp / "garbage.parquet"
    data.write_bytes(b"this is not parquet at all" * 10)
    return train_args(task, previous_run(tmp / "run"), f"data.files=[{data}]")


def parity_seq_len_zero(task, tmp):
    return ["check-parity", "--hf-path", task["model"], "--seq-len", "0"]


def convert_onto_its_source(task, tmp):
    model = tmp / "model"
    shutil.copytree(task["model"], model)
    return ["convert", "hf-to-mcore", "--hf-path", str(model), "--mcore-path", str(model), "--overwrite"]


BAD_INPUTS = [
    ("no-safetensors", no_weights, "train: error: model.hf_path='{tmp}/model' has no safetensors weights"),
    (
        "truncated-safetensors",
        truncated_weights,
        "train: error: model.hf_path='{tmp}/model': model.safetensors is truncated: its header needs",
    ),
    (
        "resume-without-driver-state",
        resume_without_driver_state,
        "train: error: trainer.resume='{tmp}/run/checkpoints/step_000003' cannot be resumed from:"
        " {tmp}/run/checkpoints/step_000003/driver_state.pt is missing: not a complete checkpoint",
    ),
    (
        "resume-truncated-distcp",
        resume_truncated_shard,
        "{tmp}/run/checkpoints/step_000002/actor/__0_0.distcp has 100 bytes, 300 when the checkpoint was written"
        " (truncated or replaced). The previous intact checkpoint is {tmp}/run/checkpoints/step_000001:"
        " set trainer.resume={tmp}/run/checkpoints/step_000001",
    ),
    (
        "resume-empty-driver-state",
        resume_empty_driver_state,
        "step_000002/driver_state.pt is unreadable (EOFError: Ran out of input; 0 bytes). The previous intact",
    ),
    (
        "resume-past-total-steps",
        resume_past_total_steps,
        "train: error: trainer.total_steps=3 but the checkpoint to resume from, {tmp}/run/checkpoints/step_000005,"
        " is at step 5; raise trainer.total_steps",
    ),
    (
        "resume-dp-sharded-optimizer-at-another-layout",
        resume_dp_sharded_at_another_layout,
        "train: error: actor.layout: the checkpoint to resume from, {tmp}/run/checkpoints/step_000002/actor, holds"
        " the optimizer state DP-sharded (saved with trainer.checkpoint_reshardable=false), which loads only at"
        " the TP/PP/VPP/CP/EP it was saved at; this run changes tp 2 -> 1: resume at that layout",
    ),
    (
        "unknown-data-source",
        unknown_data_source,
        "train: error: data.files: data_source 'mystery' has no reward function; set reward.reward_fn, or map it"
        " with reward.data_source_rewards={mystery: <reward>}",
    ),
    ("gpu-without-gpus", gpu_without_gpus, "train: error: resources.accelerator=gpu with resources.gpus_per_node="),
    ("run-dir-is-a-file", run_dir_is_a_file, "train: error: trainer.run_dir='{tmp}/run' is a file"),
    (
        "run-dir-under-a-file",
        run_dir_under_a_file,
        "train: error: trainer.run_dir='{tmp}/file/run' is under {tmp}/file, which is a file",
    ),
    ("run-dir-not-writable", run_dir_not_writable, "train: error: trainer.run_dir='/sys' is not writable"),
    ("non-utf8-jsonl", non_utf8_jsonl, "train: error: {tmp}/latin1.jsonl line 2: not UTF-8 text (byte 0xe9"),
    ("garbage-parquet", garbage_parquet, "train: error: {tmp}/garbage.parquet: not a readable parquet file"),
    ("parity-seq-len-0", parity_seq_len_zero, "check-parity: error: --seq-len=0"),
    (
        "convert-onto-its-source",
        convert_onto_its_source,
        "convert: error: --mcore-path {tmp}/model is the source --hf-path {tmp}/model",
    ),
]


def snapshot(root):
    return {str(p): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("make,expected", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_fails_in_seconds_with_one_line_before_ray_and_touches_nothing(
    tiny_task, tmp_path, capsys, make, expected
):
    argv = make(tiny_task, tmp_path)
    before = snapshot(tmp_path)
    start = time.perf_counter()
    assert cli.main(argv) == 2
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megarl "), err
    assert expected.replace("{tmp}", str(tmp_path)) in err, err
    assert seconds < 20, seconds
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert snapshot(tmp_path) == before  # config.yaml, metrics, checkpoints, the model: all as they were


def test_overrides_may_follow_options(tiny_task, capsys):
    args = overrides(tiny_task, "/tmp/unused", "trainer.prompts_per_step=8")
    assert cli.main(["config", QUICKSTART, "--validate-only", *args]) == 0
    assert "32 samples/step" in capsys.readouterr().out  # 8 prompts x 4 samples: the overrides were applied


def test_a_complete_run_says_so_instead_of_exporting_again(tiny_task, tmp_path, capsys):
    run = previous_run(tmp_path / "run", steps=(2, 3))
    (run / "hf").mkdir()
    (run / "hf/megarl_checkpoint.json").write_text("{}")
    before = snapshot(tmp_path)
    assert cli.main(train_args(tiny_task, run, "trainer.total_steps=3")) == 0
    assert "nothing to do: the run is complete at step 3" in capsys.readouterr().out
    assert snapshot(tmp_path) == before
