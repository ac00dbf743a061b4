"""Resume is never blocked by damaged state (no workers: the engines' files are stand-ins written
here, the workers' load a function): manifests, damaged checkpoints passed over or named, failing
loads falling back, crash-safe pruning, torn metrics.jsonl lines."""

import json

import pytest

from megarl.trainer import state
from megarl.trainer.metrics import _truncate_after, read_metrics


def save(run_dir, step, shard_bytes=64):
    """A checkpoint as the loop writes one: engine files first, then manifest + driver state."""
    directory = state.step_dir(run_dir, step)
    (directory / "actor").mkdir(parents=True)
    (directory / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * (shard_bytes // 256 + 1))
    (directory / "actor" / "megarl_checkpoint.json").write_text(json.dumps({"step": step}))
    state.save_driver_state(directory, state.DriverState(step, {"epoch": 0, "position": step}))
    return directory


def truncate(path, keep=10):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.fixture
def run(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    return tmp_path


def test_a_checkpoint_records_its_files_and_an_intact_one_verifies(run):
    directory = state.step_dir(run, 3)
    manifest = json.loads((directory / state.MANIFEST).read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"actor/__0_0.distcp", "actor/megarl_checkpoint.json"}
    assert state.checkpoint_problem(directory) is None
    assert state.plan_resume("auto", run).directory == directory and state.plan_resume("auto", run).step == 3


@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda d: truncate(d / "actor/__0_0.distcp"), "actor/__0_0.distcp has 10 bytes"),
        (lambda d: (d / state.DRIVER_STATE).write_bytes(b""), "driver_state.pt is unreadable (EOFError"),
        (
            lambda d: (d / "actor/megarl_checkpoint.json").write_text('{"step": 9}'),
            "megarl_checkpoint.json does not match",
        ),
        (lambda d: (d / "actor/__0_0.distcp").unlink(), "actor/__0_0.distcp is missing"),
    ],
    ids=["truncated-shard", "empty-driver-state", "corrupted-small-file", "missing-shard"],
)
def test_auto_passes_over_a_damaged_latest_checkpoint_names_the_file_and_sets_it_aside(run, capsys, damage, named):
    latest = state.step_dir(run, 3)
    damage(latest)
    assert named in state.checkpoint_problem(latest)
    plan = state.plan_resume("auto", run)
    assert plan.directory == state.step_dir(run, 2) and plan.step == 2 and plan.damaged[0][0] == latest
    loaded = []
    assert state.resume_from("auto", run, lambda d: loaded.append(d) or state.load_driver_state(d).step) == 2
    assert loaded == [state.step_dir(run, 2)]
    err = capsys.readouterr().err
    assert (
        named in err and "continuing from the previous intact checkpoint" in err and str(state.step_dir(run, 2)) in err
    )
    assert not latest.exists() and len(list(run.glob("checkpoints/step_000003.damaged-*"))) == 1
    assert [s for s, _ in state.complete_checkpoints(run)] == [1, 2]


def test_an_explicit_damaged_checkpoint_names_the_file_and_the_one_to_use_instead(run):
    (state.step_dir(run, 3) / state.DRIVER_STATE).write_bytes(b"")
    with pytest.raises(
        state.ResumeError,
        match=r"driver_state.pt is unreadable .*EOFError.*previous intact checkpoint"
        r" is .*step_000002: set trainer.resume=",
    ):
        state.plan_resume(str(state.step_dir(run, 3)), run)


def test_an_explicit_step_dir_without_driver_state_or_a_run_dir_says_what_to_set(run, tmp_path):
    incomplete = state.step_dir(run, 4)
    (incomplete / "actor").mkdir(parents=True)
    with pytest.raises(state.ResumeError, match="driver_state.pt is missing: not a complete checkpoint.*step_000003"):
        state.plan_resume(str(incomplete), run)
    with pytest.raises(state.ResumeError, match="is a run directory: set trainer.run_dir=.* trainer.resume=auto"):
        state.plan_resume(str(run), tmp_path / "elsewhere")
    with pytest.raises(state.ResumeError, match="does not exist.*trainer.resume=never starts over"):
        state.plan_resume(str(tmp_path / "nope"), run)


def test_a_load_that_fails_in_the_workers_falls_back_with_auto_and_names_the_fallback_otherwise(run, capsys):
    def load(directory):
        if directory == state.step_dir(run, 3):
            raise RuntimeError("CheckpointException ranks {0}: EOFError")
        return state.load_driver_state(directory).step

    assert state.resume_from("auto", run, load) == 2
    assert "loading checkpoint" in capsys.readouterr().err
    with pytest.raises(
        state.ResumeError,
        match=r"loading .*step_000003 failed \(RuntimeError: CheckpointException.*"
        r"previous intact checkpoint is .*step_000002",
    ):
        state.resume_from(str(state.step_dir(run, 3)), run, load)

    def never_loads(directory):
        raise ValueError("optimizer groups differ")

    with pytest.raises(
        state.ResumeError, match="no checkpoint of the run loads: .*step_000003.*step_000002.*step_000001"
    ):
        state.resume_from("auto", run, never_loads)
    assert state.resume_from("never", run, never_loads) == 0


def test_pruning_renames_before_deleting_and_cleans_up_after_a_crash(run):
    crashed = state.checkpoints_dir(run) / ".step_000000.deleting"  # a run killed mid-prune
    (crashed / "actor").mkdir(parents=True)
    assert state.prune_checkpoints(run, keep=1) == [state.step_dir(run, 1), state.step_dir(run, 2)]
    assert sorted(p.name for p in state.checkpoints_dir(run).iterdir()) == ["step_000003"]


def test_metrics_truncation_drops_a_torn_last_line_with_a_warning_and_replaces_the_file_atomically(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(4)) + '{"step": 4, "x": "tor')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    _truncate_after(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    assert "its last line does not parse" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left
    path.write_bytes(b'{"step": 0}\n\xff\xfe\n{"step": 1}\n')  # not UTF-8 in the middle
    _truncate_after(path, 5)
    assert [r["step"] for r in read_metrics(path)] == [0, 1] and "line 2 does not parse" in capsys.readouterr().err
    _truncate_after(path, 0)  # starting over (no checkpoint): the old step-0 validation goes too
    assert read_metrics(path) == [] and path.is_file()


def test_leftovers_of_killed_runs_are_removed_and_checkpoints_kept(run):
    leftovers = [
        run / ".hf.incomplete-1-2",
        state.step_dir(run, 3) / ".actor.incomplete-9-9",
        state.checkpoints_dir(run) / ".step_000001.deleting",
    ]
    for path in leftovers:
        (path / "sub").mkdir(parents=True)
    (run / ".metrics.jsonl.tmp-7").write_text("{}")
    assert sorted(state.remove_leftovers(run)) == sorted([*leftovers, run / ".metrics.jsonl.tmp-7"])
    assert not any(p.exists() for p in leftovers) and [s for s, _ in state.complete_checkpoints(run)] == [1, 2, 3]
    assert state.checkpoint_problem(state.step_dir(run, 3)) is None


def test_a_truncated_torch_dist_shard_is_found_without_a_manifest(tmp_path):
    """Engine checkpoints are torch_dist: `.metadata` says where each item ends in which .distcp file."""
    import torch
    import torch.distributed.checkpoint as dcp

    directory = state.step_dir(tmp_path, 1)
    dcp.save({"w": torch.arange(4096.0), "b": torch.ones(8)}, checkpoint_id=str(directory / "actor"), no_dist=True)
    state.save_driver_state(directory, state.DriverState(1))
    assert state.checkpoint_problem(directory) is None
    (directory / state.MANIFEST).unlink()  # a checkpoint from before manifests
    shard = sorted(directory.glob("actor/*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{shard} has 100 bytes but its items end at byte" in state.checkpoint_problem(directory)
    (directory / "actor/.metadata").write_bytes(b"garbage")
    assert "actor/.metadata is unreadable" in state.checkpoint_problem(directory)
