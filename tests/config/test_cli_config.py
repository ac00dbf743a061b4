"""`megarl config CONFIG.yaml [overrides...]`: prints the resolved YAML, validates; bad input -> one line, exit 2."""

from pathlib import Path

import yaml

from megarl.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_config_prints_resolved_yaml_with_overrides(capsys):
    rc = main(["config", str(CONFIGS / "llama3-70b_ppo.yaml"), "actor.optim.lr=1e-7", "--no-check-paths"])
    out = capsys.readouterr().out
    assert rc == 0
    resolved = yaml.safe_load(out)
    assert resolved["actor"]["optim"]["lr"] == 1e-7 and resolved["actor"]["layout"]["pp"] == 4
    assert resolved["trainer"]["seed"] == 42  # a default from code, written out
    assert out.rstrip().splitlines()[-1].startswith("# ok: roles: actor dp=2/64 GPUs")


def test_validate_only_checks_paths_unless_told_not_to(capsys):
    assert main(["config", str(CONFIGS / "qwen2.5-7b_grpo_gsm8k.yaml"), "--validate-only", "--no-check-paths"]) == 0
    assert capsys.readouterr().out.startswith("# ok:")
    assert main(["config", str(CONFIGS / "qwen2.5-7b_grpo_gsm8k.yaml"), "--validate-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megarl config: error: data.files: '/data/gsm8k/train.parquet'")


def test_bad_override_is_one_line_exit_2(capsys):
    rc = main(["config", str(CONFIGS / "grpo_quickstart.yaml"), "rollout.samples_per_promt=8", "--validate-only"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "did you mean rollout.samples_per_prompt?" in err


def test_explain_documents_every_field(capsys):
    assert main(["config", str(CONFIGS / "grpo_quickstart.yaml"), "--explain", "--no-check-paths"]) == 0
    out = capsys.readouterr().out
    assert "# Responses sampled per prompt (the GRPO group size).\n  samples_per_prompt: 8" in out
    body = [ln for ln in out.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    commented = out.count("\n#") + out.count("\n  #") + out.count("\n    #")
    assert commented >= len(body) - 1  # one docstring per key
