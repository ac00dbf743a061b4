"""Typed config loading: defaults in code <- YAML (with `defaults:` chains) <- dotted overrides."""

import dataclasses
import typing

import pytest

from megarl.config import (
    ConfigError,
    RunConfig,
    build,
    field_docs,
    load_config,
    parse_override,
    save_resolved,
    to_dict,
)


def _dataclass_tree(cls, seen=None):
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for hint in typing.get_type_hints(cls).values():
        for candidate in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(candidate):
                _dataclass_tree(candidate, seen)
    return seen


def test_every_field_of_the_config_tree_has_a_docstring():
    missing = []
    for cls in _dataclass_tree(RunConfig):
        docs = field_docs(cls)
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if f.init and not docs.get(f.name)]
    assert not missing, f"fields without a one-line docstring: {missing}"


def test_defaults_load_with_no_files():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.actor.optim is not None and cfg.ref.optim is None


def test_yaml_chain_then_overrides_win(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer: {prompts_per_step: 16, seed: 1}\nactor: {layout: {tp: 2}}\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ntrainer: {seed: 2}\nactor: {optim: {lr: 3.0e-6}}\n")
    cfg = load_config(
        tmp_path / "child.yaml", ["trainer.seed=3", "actor.optim.lr=1e-6", "data.files=[a.parquet, b.parquet]"]
    )
    assert cfg.trainer.prompts_per_step == 16  # from base
    assert cfg.actor.layout.tp == 2  # base mapping merged key by key
    assert cfg.trainer.seed == 3  # override beats child beats base
    assert cfg.actor.optim.lr == 1e-6  # YAML 1.1 reads 1e-6 as a string: coerced for a float field
    assert cfg.data.files == ["a.parquet", "b.parquet"]
    assert cfg.actor.optim.decay_style == "constant"  # untouched default


def test_unknown_key_names_the_closest_field():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lrr .* did you mean actor\.optim\.lr\?"):
        load_config(overrides=["actor.optim.lrr=1e-6"])
    with pytest.raises(ConfigError, match=r"did you mean rollout\.samples_per_prompt\?"):
        load_config(overrides=["rollout.sample_per_prompt=8"])
    with pytest.raises(ConfigError, match="did you mean algorithm"):
        build(RunConfig, {"algorithms": {}})


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.layout.tp=two", r"actor\.layout\.tp: expected int, got str 'two'"),
        ("trainer.total_steps=1.5", r"trainer\.total_steps: expected int, got float"),
        ("critic.enabled=3", r"critic\.enabled: expected bool, got int"),
        ("data.files=a.parquet", r"data\.files: expected a list"),
        ("resources.pools={main: x}", r"resources\.pools\.main: expected int"),
        ("actor.optim.lr=fast", r"actor\.optim\.lr: expected float"),
        ("actor=3", r"actor must be a mapping"),
    ],
)
def test_wrong_types_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_dataclass_checks_are_prefixed_with_the_section():
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: gamma and lam must lie in \[0, 1\]"):
        load_config(overrides=["algorithm.advantage.gamma=2"])
    with pytest.raises(ConfigError, match=r"actor\.layout: layout\.vpp=2 needs pp > 1"):
        load_config(overrides=["actor.layout.vpp=2"])


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        parse_override("actor.optim.lr")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_save_resolved_round_trips(tmp_path):
    cfg = load_config(
        "configs/ppo_quickstart.yaml", ["actor.optim.lr=2e-5", "actor.optim.min_lr=2e-6", "resources.pools={main: 2}"]
    )
    path = save_resolved(cfg, tmp_path / "run")
    assert path.name == "config.yaml" and path.read_text().startswith("# megarl resolved config")
    again = load_config(path)
    assert again == cfg
    assert to_dict(again)["actor"]["optim"]["lr"] == 2e-5
    assert not list((tmp_path / "run").glob(".*tmp*"))  # no staging file left behind
    text = path.read_text()  # every field documented in place, and still plain YAML
    assert "  # Peak learning rate (reached after `warmup_steps`).\n    lr: 2.0e-05" in text
    assert load_config(path) == cfg


@dataclasses.dataclass
class _Typed:
    seq: typing.Sequence[int] = (1,)
    """x"""
    mapping: typing.Mapping[str, float] = dataclasses.field(default_factory=dict)
    """x"""
    pair: tuple[int, ...] = ()
    """x"""
    either: typing.Union[int, str] = 0
    """x"""


def test_generic_field_types_are_checked():
    built = build(_Typed, {"seq": [1, 2], "mapping": {"a": 1}, "pair": [3, 4], "either": "x"})
    assert built == _Typed([1, 2], {"a": 1.0}, (3, 4), "x")
    with pytest.raises(ConfigError, match=r"seq\[1\]: expected int, got str"):
        build(_Typed, {"seq": [1, "b"]})
    with pytest.raises(ConfigError, match=r"either: expected int or str, got list"):
        build(_Typed, {"either": [1]})
