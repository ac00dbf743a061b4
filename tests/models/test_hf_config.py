"""HF config validation and layout checks: clear errors before any weight is read."""

import json

import pytest

from megarl.models.hf_config import UnsupportedModelError, describe_hf_config, load_hf_config
from megarl.models.layout import LayoutError, ParallelLayout
from megarl.testing.models import tiny_hf_config


@pytest.mark.parametrize(
    "arch,qkv_bias,qk_norm,tied,head_dim",
    [
        ("llama", False, False, False, 16),
        ("qwen2", True, False, True, 16),
        ("qwen3", False, True, False, 32),
        ("mistral", False, False, False, 16),
    ],
)
def test_describe_families(arch, qkv_bias, qk_norm, tied, head_dim):
    dims = describe_hf_config(tiny_hf_config(arch))
    assert (dims.qkv_bias, dims.qk_norm, dims.tie_word_embeddings, dims.head_dim) == (qkv_bias, qk_norm, tied, head_dim)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2' is not supported; supported: \['llama'"):
        load_hf_config(tmp_path)


def test_missing_and_corrupt_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)


def test_sliding_window_and_unknown_rope_are_refused():
    with pytest.raises(UnsupportedModelError, match="sliding_window=32"):
        describe_hf_config(tiny_hf_config("mistral", sliding_window=32))
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        describe_hf_config(
            tiny_hf_config(
                "llama", rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)
            )
        )


@pytest.mark.parametrize(
    "layout,message",
    [
        (ParallelLayout(tp=3), "num_attention_heads=4 is not divisible by tp=3"),
        (ParallelLayout(tp=4), "num_key_value_heads=2 is not divisible by tp=4"),
        (ParallelLayout(pp=2, vpp=2), r"num_hidden_layers=2 is not divisible by pp\*vpp = 2\*2 = 4"),
        (ParallelLayout(ep=2), "needs a mixture-of-experts model"),
    ],
)
def test_indivisible_layouts_name_the_sizes(layout, message):
    dims = describe_hf_config(tiny_hf_config("llama"))
    with pytest.raises(LayoutError, match=message):
        layout.check_model(num_layers=dims.num_layers, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads)


def test_layout_rejects_nonpositive_sizes_and_vpp_without_pp():
    with pytest.raises(LayoutError, match="layout.tp=0"):
        ParallelLayout(tp=0)
    with pytest.raises(LayoutError, match="needs pp > 1"):
        ParallelLayout(vpp=2)
    with pytest.raises(LayoutError, match="world size 6 is not divisible"):
        ParallelLayout(tp=4).dp_size(6)


_DRIVER_LOADS = """
import importlib, json, sys
from megarl.data.tokenizer import load_tokenizer
from megarl.models.hf_config import load_hf_config

docstrings = importlib.import_module("transformers.utils.auto_docstring")
generate = docstrings.auto_class_docstring
paths = json.loads(sys.argv[1])
configs = {arch: load_hf_config(path).to_dict() for arch, path in paths.items() if arch != "llama"}
load_tokenizer(sys.argv[2])
heavy = [m for m in ("transformers.models.auto.modeling_auto", "torch._dynamo") if m in sys.modules]
configs["llama"] = load_hf_config(paths["llama"]).to_dict()  # its config module imports torch._dynamo itself
print(json.dumps({"configs": configs, "heavy": heavy, "restored": docstrings.auto_class_docstring is generate}))
"""


def test_a_driver_loads_configs_and_a_generic_tokenizer_without_transformers_model_imports(tmp_path):
    """What the driver reads before Ray starts (each role's config.json, the tokenizer) loads without generating
    config docstrings, whose text imports the model mappings, `generation` and torch._dynamo (1.3 s of CPU):
    in a fresh interpreter none of those is imported, and every family's config equals the one transformers
    loads itself (generating them). (Llama's config module imports torch._dynamo on its own, through
    `type_validators` → `activations`: loaded last, outside that check.)"""
    import subprocess
    import sys

    from transformers import AutoConfig

    from megarl.data.tokenizer import build_tiny_tokenizer

    paths = {}
    for arch in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe"):
        tiny_hf_config(arch).save_pretrained(tmp_path / arch)
        paths[arch] = str(tmp_path / arch)
    build_tiny_tokenizer(str(tmp_path / "tokenizer"))
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER_LOADS, json.dumps(paths), str(tmp_path / "tokenizer")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [] and got["restored"]
    for arch, path in paths.items():
        assert got["configs"][arch] == json.loads(json.dumps(AutoConfig.from_pretrained(path).to_dict())), arch
