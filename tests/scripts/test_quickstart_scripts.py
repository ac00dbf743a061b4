"""The quickstart scripts' own logic (run directory, prepared model, config), in a copy of the repository whose
set-up and Python are stubs: the stub "prepare" writes the model where it is told, the stub "train" fails unless
the model the config names is there, as `megarl train` does, and writes a run directory."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PYTHON_STUB = r"""#!/usr/bin/env bash
echo "python $*" >> "$STUB_LOG"
if [[ "$1" == scripts/prepare_* ]]; then
  while [ $# -gt 0 ]; do
    case "$1" in --model) model=$2; shift 2 ;; --data) data=$2; shift 2 ;; *) shift ;; esac
  done
  mkdir -p "$model" "$data" && echo '{}' > "$model/config.json" && touch "$data/train.parquet"
elif [ "$1 $2 $3" == "-m megarl.cli train" ]; then
  for arg in "$@"; do
    case "$arg" in trainer.run_dir=*) run=${arg#trainer.run_dir=} ;; esac
    [ "$prev" == --config ] && config=$arg
    prev=$arg
  done
  model=$(sed -n 's/^ *hf_path: *//p' "$config")
  base=$(sed -n 's/^defaults: *//p' "$config")  # a config that extends another one (ppo_quickstart.yaml)
  [ -n "$model" ] || model=$(sed -n 's/^ *hf_path: *//p' "$(dirname "$config")/$base")
  [ -f "$model/config.json" ] || { echo "megarl train: error: $model has no config.json" >&2; exit 2; }
  mkdir -p "$run" && touch "$run/config.yaml"
fi
"""


@pytest.fixture
def sandbox(tmp_path):
    for folder in ("scripts", "configs"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    (tmp_path / "scripts" / "setup.sh").write_text('echo "setup" >> "$STUB_LOG"\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(PYTHON_STUB)
    python.chmod(0o755)
    return tmp_path


def quickstart(sandbox: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "STUB_LOG": str(sandbox / "stub.log")}
    return subprocess.run(["bash", *args], cwd=sandbox, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "script, model, run_dir",
    [
        (["scripts/quickstart.sh"], "runs/quickstart/model", "runs/grpo_quickstart"),
        (["scripts/quickstart.sh", "--ppo"], "runs/quickstart/model", "runs/ppo_quickstart"),
        (["scripts/tool_quickstart.sh"], "runs/quickstart_tool/model", "runs/tool_quickstart"),
    ],
)
def test_a_quickstart_run_twice_with_its_defaults_trains_on_the_model_it_prepared(sandbox, script, model, run_dir):
    """The tool quickstart prepared its model inside its default run directory and then removed that directory
    for a fresh run: `bash scripts/tool_quickstart.sh` stopped at "has no config.json"."""
    for _ in range(2):  # the second run replaces the first one's run directory
        run = quickstart(sandbox, *script)
        assert run.returncode == 0, run.stderr
        assert (sandbox / model / "config.json").exists() and (sandbox / run_dir / "config.yaml").exists()


@pytest.mark.parametrize(
    "script, run_dir, error",
    [
        ("scripts/quickstart.sh", "runs", "run directory runs holds runs/quickstart/model"),
        ("scripts/quickstart.sh", ".", "run directory . holds runs/quickstart/model"),
        ("scripts/tool_quickstart.sh", "data", "run directory data holds data/tool_arithmetic"),
        ("scripts/tool_quickstart.sh", "runs/quickstart_tool", "holds runs/quickstart_tool/model"),
        ("scripts/quickstart.sh", "notes", "notes exists and is not a megarl run directory (no config.yaml)"),
    ],
)
def test_a_run_directory_holding_what_the_run_needs_or_anything_else_is_refused_before_any_work(
    sandbox, script, run_dir, error
):
    (sandbox / "notes").mkdir()
    (sandbox / "notes" / "mine.txt").write_text("kept")
    run = quickstart(sandbox, script, run_dir)
    assert run.returncode == 2 and error in run.stderr, run.stderr
    assert not (sandbox / "stub.log").exists()  # neither the set-up nor any Python ran
    assert (sandbox / "notes" / "mine.txt").read_text() == "kept" and (sandbox / "scripts").is_dir()


def test_the_conversion_demo_replaces_only_its_own_directories(tmp_path):
    """It removed its whole --out first, by default runs/quickstart: the GRPO quickstart's prepared model."""
    import sys

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for previous in ("hf", "mcore", "hf_roundtrip"):  # a last demo's output, which a converter would not overwrite
        (tmp_path / previous).mkdir()
        (tmp_path / previous / "stale").write_text("")
    demo = [sys.executable, "scripts/conversion_demo.py", "--out", str(tmp_path), "--tp", "1", "--pp", "1"]
    run = subprocess.run(demo, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "bit-exact: True" in run.stdout, run.stderr[-3000:]
    assert (tmp_path / "model" / "config.json").read_text() == "{}" and not list(tmp_path.glob("*/stale"))
