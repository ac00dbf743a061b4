"""OmegaConf loading: `${...}` interpolation (sections, unwritten defaults, env), dot-list overrides,
bad interpolations as ConfigError naming the field, and the resolved config written without `${`."""

import pytest

from megarl.config import ConfigError, load_config, parse_override, save_resolved


@pytest.fixture
def chain(tmp_path):
    """base.yaml ← child.yaml (defaults chain); the child interpolates keys of the base, of another
    section, a default nobody wrote, and environment variables."""
    (tmp_path / "base.yaml").write_text("trainer: {experiment: exp1}\nactor: {optim: {lr: 3.0e-6}}\n")
    (tmp_path / "child.yaml").write_text(
        "defaults: base.yaml\n"
        "trainer:\n"
        "  run_dir: ${oc.env:MEGARL_TEST_ROOT,/scratch}/${trainer.experiment}\n"
        "  total_steps: ${oc.env:MEGARL_TEST_STEPS,5}\n"
        "critic: {optim: {lr: '${actor.optim.lr}'}}\n"
        "actor: {prompts_per_update: '${trainer.prompts_per_step}'}\n"
    )
    return tmp_path / "child.yaml"


def test_yaml_interpolates_sections_unwritten_defaults_and_env(chain, monkeypatch):
    monkeypatch.delenv("MEGARL_TEST_ROOT", raising=False)
    monkeypatch.delenv("MEGARL_TEST_STEPS", raising=False)
    cfg = load_config(chain)
    assert cfg.trainer.run_dir == "/scratch/exp1" and type(cfg.trainer.run_dir) is str  # env default + base's key
    assert cfg.trainer.total_steps == 5  # the env resolver's string "5", read as the int the field wants
    assert cfg.critic.optim.lr == 3e-6  # another section, set in the base file
    assert cfg.actor.prompts_per_update == 32  # trainer.prompts_per_step: a default in code nobody wrote
    monkeypatch.setenv("MEGARL_TEST_ROOT", "/data/runs")
    monkeypatch.setenv("MEGARL_TEST_STEPS", "7")
    cfg = load_config(chain, ["actor.optim.lr=1e-5", "trainer.experiment=exp2"])
    assert (cfg.trainer.run_dir, cfg.trainer.total_steps) == ("/data/runs/exp2", 7)
    assert cfg.critic.optim.lr == 1e-5  # resolved after every file and override is merged


def test_dotlist_overrides_nested_lists_null_and_interpolations(tmp_path):
    (tmp_path / "run.yaml").write_text("rollout: {max_model_len: 1024}\nmodel: {hf_path: /m/base}\n")
    cfg = load_config(
        tmp_path / "run.yaml",
        [
            "actor.optim.lr=2e-6",
            "actor.layout.tp=2",  # nested
            "data.files=[a.parquet,b.parquet]",  # a list replaces
            "rollout.max_model_len=null",  # null clears a file's value
            "ref.hf_path=${model.hf_path}",
            "model.hf_path=/m/sft",  # interpolation resolved after later overrides
            "validation.files=${data.files}",  # to a list
            "critic.optim=${actor.optim}",  # to a whole section
        ],
    )
    assert (cfg.actor.optim.lr, cfg.actor.layout.tp, cfg.actor.layout.pp) == (2e-6, 2, 1)
    assert cfg.data.files == ["a.parquet", "b.parquet"] and cfg.validation.files == cfg.data.files
    assert cfg.rollout.max_model_len is None
    assert cfg.ref.hf_path == "/m/sft"
    assert cfg.critic.optim == cfg.actor.optim and cfg.critic.optim.lr == 2e-6
    assert parse_override("ref.hf_path=${model.hf_path}") == {"ref": {"hf_path": "${model.hf_path}"}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["critic.optim.lr=${actor.optim.lrr}"],
            r"critic\.optim\.lr: cannot resolve '\$\{actor\.optim\.lrr\}': Interpolation key 'actor\.optim\.lrr' not found; "
            r"did you mean \$\{actor\.optim\.lr\}\?",
        ),
        (
            ["trainer.seed=${trainer.total_steps}", "trainer.total_steps=${trainer.seed}"],
            r"trainer\.(seed|total_steps): cannot resolve .*Recursive interpolation",
        ),
        (
            ["trainer.run_dir=${oc.env:MEGARL_SURELY_UNSET_VAR}"],
            r"trainer\.run_dir: .*Environment variable 'MEGARL_SURELY_UNSET_VAR' not found",
        ),
        (["trainer.total_steps=${trainer.run_dir}"], r"trainer\.total_steps: expected int, got str 'runs/megarl'"),
        (["trainer.seed=${trainer.total_steps"], r"override 'trainer\.seed=.*': trainer\.seed: .*"),
        (["model.hf_path=???"], r"model\.hf_path is \?\?\? \(mandatory\)"),
        (["data.files=[${model.hf_path}]"], r"not valid YAML .*quote an interpolation"),
    ],
)
def test_bad_interpolations_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_mandatory_value_filled_by_a_later_layer(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  hf_path: ???\n")
    with pytest.raises(ConfigError, match=r"model\.hf_path is \?\?\?"):
        load_config(tmp_path / "base.yaml")
    assert load_config(tmp_path / "base.yaml", ["model.hf_path=/m"]).model.hf_path == "/m"


def test_save_resolved_writes_values_and_reloads_equal(chain, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_STEPS", "9")
    cfg = load_config(chain, [r"trainer.project=cost \${usd}"])  # an escaped, literal ${
    assert cfg.trainer.project == "cost ${usd}"
    text = save_resolved(cfg, tmp_path / "run").read_text()
    assert "total_steps: 9\n" in text and "lr: 3.0e-06\n" in text and "prompts_per_update: 32\n" in text
    assert text.count("${") == text.count("\\${") == 1  # values only; the literal stays escaped
    monkeypatch.delenv("MEGARL_TEST_STEPS")
    assert load_config(tmp_path / "run" / "config.yaml") == cfg
