"""mcore→hf without megatron-core (`megarl.models.dcp_export`): bit-exact from every written layout, the
same files as the megatron path, bad checkpoints refused with nothing published, and the megatron path
kept where the export does not apply."""

import json
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megarl.models import dcp_export
from megarl.models.convert import (
    MARKER,
    export_in_process,
    hf_to_mcore,
    mcore_to_hf,
    mcore_to_hf_rank,
    plan_mcore_to_hf,
    run_plan,
)
from megarl.models.hf_io import INDEX_FILE, CheckpointError
from megarl.models.layout import ParallelLayout


def _tensors(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_same_tensors(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb)
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not different, different


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", ParallelLayout()),
        ("qwen2", ParallelLayout(tp=2, pp=2)),  # QKV bias
        ("qwen3_4layers", ParallelLayout(pp=2, vpp=2)),  # QK norm; virtual stages renumber the layers
    ],
)
def test_export_is_bit_exact_from_any_written_layout(tiny_models, tmp_path, arch, layout):
    hf_to_mcore(tiny_models[arch], tmp_path / "mcore", layout)
    assert dcp_export.applies(plan_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf"))
    summary = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    _assert_same_tensors(tiny_models[arch], tmp_path / "hf")
    assert summary["tensors"] == len(_tensors(tiny_models[arch]))
    assert json.loads((tmp_path / "hf" / MARKER).read_text())["kind"] == "hf-export"
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / INDEX_FILE).is_file()


def test_export_writes_what_the_megatron_path_writes(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["qwen3"], tmp_path / "mcore", ParallelLayout(tp=2))
    fast = export_in_process(plan_mcore_to_hf(tmp_path / "mcore", tmp_path / "fast"))
    slow = run_plan(mcore_to_hf_rank, plan_mcore_to_hf(tmp_path / "mcore", tmp_path / "slow"))
    assert fast == slow
    _assert_same_tensors(tmp_path / "fast", tmp_path / "slow")
    index = [json.loads((tmp_path / d / INDEX_FILE).read_text())["weight_map"].keys() for d in ("fast", "slow")]
    assert index[0] == index[1]
    assert sorted(p.name for p in (tmp_path / "fast").iterdir()) == sorted(
        p.name for p in (tmp_path / "slow").iterdir()
    )


def test_the_megatron_path_is_kept_where_the_export_does_not_apply(tiny_models, tmp_path, monkeypatch):
    hf_to_mcore(tiny_models["qwen2_moe"], tmp_path / "moe")
    assert not dcp_export.applies(plan_mcore_to_hf(tmp_path / "moe", tmp_path / "a"))  # expert axes
    hf_to_mcore(tiny_models["llama"], tmp_path / "dense")
    assert not dcp_export.applies(plan_mcore_to_hf(tmp_path / "dense", tmp_path / "b", ParallelLayout(tp=2)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not dcp_export.applies(plan_mcore_to_hf(tmp_path / "dense", tmp_path / "c"))  # under torchrun


def test_the_export_imports_no_megatron(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["llama"], tmp_path / "mcore")
    code = (
        "import sys; from megarl.models.convert import mcore_to_hf;"
        f" mcore_to_hf({str(tmp_path / 'mcore')!r}, {str(tmp_path / 'hf')!r});"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'vllm', 'ray')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "[]", run.stderr[-3000:]
    _assert_same_tensors(tiny_models["llama"], tmp_path / "hf")


def _drop_from_metadata(mcore, key: str):
    metadata = pickle.loads((mcore / ".metadata").read_bytes())
    del metadata.state_dict_metadata[key]
    (mcore / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_checkpoint_missing_a_parameter_is_refused_and_nothing_is_published(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["qwen2"], tmp_path / "mcore")
    _drop_from_metadata(tmp_path / "mcore", "decoder.final_layernorm.weight")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["mcore"]


def test_a_corrupt_record_fails_the_export_and_keeps_the_previous_export(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["qwen2"], tmp_path / "mcore")
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    before = _tensors(tmp_path / "hf")
    for distcp in (tmp_path / "mcore").glob("*.distcp"):  # torn writes: each file cut in half
        distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="damaged"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", overwrite=True)
    after = _tensors(tmp_path / "hf")
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mcore"]  # no staging directory left


def test_a_config_with_another_layer_count_is_refused(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["llama"], tmp_path / "mcore")
    config = json.loads((tmp_path / "mcore" / "hf" / "config.json").read_text())
    (tmp_path / "mcore" / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="holds 2 layers, but its hf/config.json has 1"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_export_in_another_dtype_says_so_in_its_config(tiny_models, tmp_path):
    """A float32 model converted with --dtype bfloat16 exports bfloat16 weights, and its config.json (copied
    from the float32 source) names bfloat16: transformers and vLLM load dtype="auto" from it."""
    from transformers import AutoConfig

    hf_to_mcore(tiny_models["qwen2"], tmp_path / "mcore", dtype="bfloat16")
    for name, layout in (("tp1", ParallelLayout()), ("tp2", ParallelLayout(tp=2))):
        mcore_to_hf(tmp_path / "mcore", tmp_path / name, layout)
        assert {t.dtype for t in _tensors(tmp_path / name).values()} == {torch.bfloat16}
        assert AutoConfig.from_pretrained(tmp_path / name).dtype == torch.bfloat16, name


def test_a_trainer_step_directory_is_refused_naming_its_role_checkpoints(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["llama"], tmp_path / "step_000010" / "actor")
    with pytest.raises(CheckpointError, match=r"step directory holding the checkpoints \['actor'\].*step_000010/actor"):
        mcore_to_hf(tmp_path / "step_000010", tmp_path / "hf")


def test_ctrl_c_inside_torchs_reader_stops_the_export_as_an_interrupt(tiny_models, tmp_path, monkeypatch):
    """torch's C++ zip reader reports an exception raised in the file's `readinto` as an AttributeError;
    an interrupt there must still stop the export as KeyboardInterrupt (exit 130), publishing nothing."""
    hf_to_mcore(tiny_models["llama"], tmp_path / "mcore")
    reads = []
    real_file = dcp_export._Chunks._file

    class Interrupted:  # the checkpoint file, where the fifth read is when Ctrl-C arrives
        def __init__(self, stream):
            self.stream = stream

        def readinto(self, buffer):
            reads.append(len(buffer))
            if len(reads) == 5:
                raise KeyboardInterrupt
            return self.stream.readinto(buffer)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    monkeypatch.setattr(dcp_export._Chunks, "_file", lambda self, info: Interrupted(real_file(self, info)))
    with pytest.raises(KeyboardInterrupt):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["mcore"]


def test_a_missing_data_file_is_named(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["qwen2"], tmp_path / "mcore", ParallelLayout(tp=2))
    victim = sorted((tmp_path / "mcore").glob("*.distcp"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name} is missing"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")


def test_a_truncated_metadata_file_is_named(tiny_models, tmp_path):
    hf_to_mcore(tiny_models["llama"], tmp_path / "mcore")
    index = tmp_path / "mcore" / ".metadata"
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
