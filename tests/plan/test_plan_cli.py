"""`megarl plan` (table, --json, --search, hardware overrides) and `megarl config --validate-only`'s
predicted memory lines; the search enumerates exactly the layouts config validation accepts."""

import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config, validate
from megarl.config.validate import check_layouts_fit
from megarl.plan import gpu_spec, plan_run
from megarl.plan.presets import PRESETS, resolve_dims
from megarl.plan.search import search

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = ("qwen2.5-7b_grpo_gsm8k.yaml", "llama3-70b_ppo.yaml", "qwen3-30b-a3b_dapo_math.yaml")


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_table_of_shipped_configs(capsys, name):
    assert main(["plan", "--config", str(CONFIGS / name)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPU H100: 79.6 GiB HBM")
    assert "actor " in out and "KV cache" in out and "time per step:" in out
    assert ("fits: margin" in out) != ("DOES NOT FIT" in out)


def test_plan_json_and_hardware_overrides(capsys):
    args = ["plan", "--config", str(CONFIGS / "llama3-70b_ppo.yaml"), "--json"]
    assert main(args) == 0
    h100 = json.loads(capsys.readouterr().out)
    assert main(args + ["--gpu", "h100", "--hbm-gb", "40"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert h100["gpu"]["hbm_bytes"] == 81559 * 2**20 and small["gpu"]["hbm_bytes"] == 40 * 10**9
    assert h100["roles"]["actor"] == small["roles"]["actor"]  # the role's needs do not depend on the GPU
    assert small["vllm"]["budget"] == int(0.5 * 40 * 10**9)  # vLLM's share is a fraction of HBM
    assert small["margin"] < 0 < h100["margin"] and not small["fits"] and small["warnings"]
    assert h100["fits"] and set(h100["phases"]["main"]) >= {"generate", "actor update", "weight sync"}
    assert main(args + ["--tflops", "494.5"]) == 0
    slow = json.loads(capsys.readouterr().out)
    ratio = slow["times"]["actor update"] / h100["times"]["actor update"]
    assert 1.5 < ratio < 2  # the FLOPs take twice as long; the collectives do not


def test_plan_counts_the_sync_bucket_size(capsys):
    """`rollout.sync_bucket_mb` sizes the weight-sync phase's buffers: three buckets on a colocated rollout rank
    and two packed shares (bucket / actor tp) on the sender it also is."""
    args = ["plan", "--config", str(CONFIGS / "llama3-70b_ppo.yaml"), "--json"]
    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(args + ["rollout.sync_bucket_mb=1024"]) == 0
    large = json.loads(capsys.readouterr().out)
    tp = load_config(CONFIGS / "llama3-70b_ppo.yaml").actor.layout.tp
    grown = large["phases"]["main"]["weight sync"] - default["phases"]["main"]["weight sync"]
    assert grown == 3 * (768 << 20) + 2 * (768 << 20) // tp


def test_plan_by_hf_config_and_bad_input(capsys, tmp_path):
    assert main(["plan", "--hf-config", "qwen3-30b-a3b", "resources.gpus_per_node=8", "data.files=[x]"]) == 0
    assert "ep1" in capsys.readouterr().out
    assert main(["plan", "--hf-config", str(tmp_path / "nowhere")]) == 2
    assert "not a known preset" in capsys.readouterr().err
    assert main(["plan", "--hf-config", "qwen2.5-7b", "--gpu", "V100"]) == 2
    assert "pick one of H100, H200, A100, B200" in capsys.readouterr().err


def test_search_ranks_only_layouts_config_validation_accepts():
    cfg = load_config(CONFIGS / "qwen3-30b-a3b_dapo_math.yaml")
    dims = PRESETS["qwen3-30b-a3b"]
    found = search(cfg, dims, gpu_spec("H100"))
    assert len(found) > 10
    for c in found:
        check_layouts_fit(c.config, {"actor": dims}, dims)  # raises for an invalid layout
        assert c.config.actor.layout.ep == c.ep and c.config.rollout.tp == c.rollout_tp
        assert 16 % (c.tp * c.pp) == 0 and (16 // (c.tp * c.pp)) % c.ep == 0  # ep | dp on the 16-GPU pool
    fits = [c for c in found if c.plan.fits]
    assert fits and found[: len(fits)] == fits  # fitting layouts first
    times = [round(c.plan.step_time, 1) for c in fits]
    assert times == sorted(times)  # ties (within 0.1 s) go to the larger margin
    assert {c.ep for c in found} >= {1, 2, 4, 8, 16}


def test_search_cli_table_and_json(capsys):
    base = ["plan", "--config", str(CONFIGS / "qwen2.5-7b_grpo_gsm8k.yaml"), "--search", "--top", "3"]
    assert main(base) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["#", "layout", "fits", "margin"] and len(out) == 5
    assert out[-1].endswith("predicted to fit")
    assert main(base + ["--json", "--gpus", "16"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and all(r["fits"] for r in rows)
    assert round(rows[0]["step_time"], 1) <= round(rows[1]["step_time"], 1) <= round(rows[2]["step_time"], 1)


def test_validate_only_prints_predicted_memory_and_warns_without_failing(capsys):
    cfg = str(CONFIGS / "llama3-70b_ppo.yaml")
    assert main(["config", cfg, "--validate-only", "--no-check-paths"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ok:") and lines[1].startswith("# plan (H100, 79.6 GiB): predicted peak per GPU:")
    assert "actor " in lines[1] and "critic " in lines[1] and "# warning" not in "\n".join(lines)
    assert (
        main(
            [
                "config",
                cfg,
                "--validate-only",
                "--no-check-paths",
                "actor.layout={tp: 1, pp: 1, vpp: 1}",
                "actor.offload=false",
            ]
        )
        == 0
    )  # predicted not to fit: a warning, not an error
    out = capsys.readouterr().out
    assert "# warning: pool 'main': actor update needs" in out


def test_validate_only_skips_the_plan_for_unknown_cluster_models(capsys):
    cfg = str(CONFIGS / "llama3-70b_ppo.yaml")
    assert main(["config", cfg, "--validate-only", "--no-check-paths", "model.hf_path=/models/Unknown-9B"]) == 0
    assert "# plan: skipped" in capsys.readouterr().out


def test_resolve_dims_reads_local_checkpoints(tmp_path):
    from megarl.testing.models import tiny_hf_config

    tiny_hf_config("qwen2").save_pretrained(tmp_path / "m")
    dims = resolve_dims(str(tmp_path / "m"))
    assert dims.hidden_size == 64 and dims.num_layers == 2
    with pytest.raises(ValueError, match="preset"):
        resolve_dims("/models/nothing-here")


def test_plan_refuses_sizes_config_validation_refuses():
    cfg = load_config(CONFIGS / "llama3-70b_ppo.yaml", ["actor.layout={tp: 8, pp: 3}"])
    with pytest.raises(ConfigError, match="does not divide"):
        plan_run(cfg, PRESETS["meta-llama-3-70b-instruct"], gpu_spec("H100"))
    with pytest.raises(ConfigError):
        validate(cfg, check_paths=False)


def test_gpus_resizes_the_pool(capsys):
    base = ["plan", "--config", str(CONFIGS / "llama3-70b_ppo.yaml"), "--json"]
    assert main(base + ["--gpus", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["role_dp"]["actor"] == 4  # tp8 pp4 on 128 GPUs
    assert main(base + ["--gpus", "12"]) == 2
    assert "not a multiple of resources.gpus_per_node=8" in capsys.readouterr().err
