"""The quickstarts' prepare scripts reuse a current build and rebuild a stale one (`megarl.utils.prepared`)."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from megarl.utils.prepared import MARKER, PreparedCache

REPO = Path(__file__).resolve().parents[2]


def _cache(tmp_path, code: Path, **args):
    namespace = argparse.Namespace(model=str(tmp_path / "model"), data=str(tmp_path / "data"), force=False, **args)
    return PreparedCache(tmp_path / "model" / MARKER, script=code, args=namespace, inputs=[tmp_path / "lib"])


@pytest.fixture
def built(tmp_path):
    """A fake build: a model directory, a data file, a script and a library directory the key covers."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w" * 100)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"rows")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sft.py").write_text("steps = 1\n")
    (tmp_path / "prepare.py").write_text("print('prepare')\n")
    cache = _cache(tmp_path, tmp_path / "prepare.py", seed=0)
    cache.save({"accuracy": 0.5}, "built", outputs=[tmp_path / "model", tmp_path / "data" / "train.parquet"])
    return tmp_path


def test_current_build_is_reused(built):
    hit = _cache(built, built / "prepare.py", seed=0).load()
    assert hit["results"] == {"accuracy": 0.5} and hit["summary"] == "built"
    assert sorted(Path(p).name for p in hit["files"]) == ["train.parquet", "weights.bin"]  # not the marker itself


@pytest.mark.parametrize(
    "change",
    ["argument", "script", "library code", "output changed", "output removed", "marker torn", "moved elsewhere"],
)
def test_stale_build_is_rebuilt(built, change, monkeypatch, tmp_path_factory):
    args = {"seed": 0}
    if change == "argument":
        args = {"seed": 1}
    elif change == "script":
        (built / "prepare.py").write_text("print('prepare, changed')\n")
    elif change == "library code":
        (built / "lib" / "sft.py").write_text("steps = 2\n")
    elif change == "output changed":
        (built / "data" / "train.parquet").write_bytes(b"other rows")
    elif change == "output removed":
        (built / "model" / "weights.bin").unlink()
    elif change == "marker torn":
        marker = built / "model" / MARKER
        marker.write_text(marker.read_text()[:50])
    elif change == "moved elsewhere":  # the same relative paths from another directory name other files
        monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
        namespace = argparse.Namespace(model="model", data="data", force=False, seed=0)
        cache = PreparedCache(
            built / "model" / MARKER, script=built / "prepare.py", args=namespace, inputs=[built / "lib"]
        )
        assert cache.load() is None
        return
    assert _cache(built, built / "prepare.py", **args).load() is None


def test_library_versions_are_part_of_the_key(built, monkeypatch):
    import megarl.utils.prepared as prepared

    monkeypatch.setattr(prepared, "_version", lambda name: "0.0-other")
    assert _cache(built, built / "prepare.py", seed=0).load() is None


def _prepare_quickstart():
    spec = importlib.util.spec_from_file_location("prepare_quickstart", REPO / "scripts" / "prepare_quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_quickstart_reuses_its_build_until_forced_or_changed(tmp_path, capsys):
    """The real script: a second run reuses the model and data (same results, no warm-up); --force, another
    seed or a changed output file builds again."""
    script = _prepare_quickstart()
    argv = ["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--sft-steps", "3"]
    argv += ["--train-rows", "60", "--test-problems", "20"]
    first = script.main(argv)
    weights = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "m" / MARKER).read_text())["results"] == first
    capsys.readouterr()

    assert script.main(argv) == first
    assert "reused" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == weights

    for rerun in (argv + ["--force"], argv + ["--seed", "1"]):
        script.main(rerun)
        assert "reused" not in capsys.readouterr().out
    (tmp_path / "d" / "test.parquet").write_bytes(b"not parquet")  # the last build (seed 1) is stale now
    script.main(argv + ["--seed", "1"])
    assert "reused" not in capsys.readouterr().out
