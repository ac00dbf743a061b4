"""validate(cfg): bad configs fail up front, in milliseconds, naming the field and the fix."""

import time
from pathlib import Path

import pytest

from megarl.config import ConfigError, derive, load_config, validate
from megarl.data.tasks import write_task_splits
from megarl.data.tokenizer import build_tiny_tokenizer
from megarl.testing.models import tiny_hf_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))
QUICKSTARTS = ("grpo_quickstart.yaml", "ppo_quickstart.yaml")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A tiny qwen2 config.json (4 heads, 2 KV heads, 2 layers) and arithmetic train/test parquet."""
    root = tmp_path_factory.mktemp("local")
    tiny_hf_config("qwen2").save_pretrained(root / "model")
    build_tiny_tokenizer(str(root / "model"))
    (root / "bare").mkdir()
    tiny_hf_config("qwen2").save_pretrained(root / "bare")  # a config.json without a tokenizer
    paths = write_task_splits("arithmetic", 40, str(root / "data"))
    (root / "other.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    return {"model": str(root / "model"), "train": paths["train"], "test": paths["test"], "root": str(root)}


def _local_overrides(local) -> list[str]:
    return [f"model.hf_path={local['model']}", f"data.files=[{local['train']}]", f"validation.files=[{local['test']}]"]


def _cfg(local, *overrides, file="grpo_quickstart.yaml"):
    return load_config(CONFIGS / file, [*_local_overrides(local), *overrides])


def test_all_four_configs_ship():
    assert {"grpo_quickstart.yaml", "ppo_quickstart.yaml", "qwen2.5-7b_grpo_gsm8k.yaml", "llama3-70b_ppo.yaml"} <= set(
        SHIPPED
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_validates_without_local_paths(name):
    derived = validate(load_config(CONFIGS / name), check_paths=False)
    assert derived.samples_per_step > 0
    header = "".join(line for line in (CONFIGS / name).read_text().splitlines(True) if line.startswith("#"))
    assert "megarl train --config" in header or "sbatch " in header, f"{name}: document its launch command"


@pytest.mark.parametrize("name", ["qwen2.5-7b_grpo_gsm8k.yaml", "llama3-70b_ppo.yaml"])
def test_cluster_config_with_path_checks_names_the_missing_file(name):
    with pytest.raises(ConfigError, match=r"data\.files: '/data/.*' does not exist.*--no-check-paths"):
        validate(load_config(CONFIGS / name), check_paths=True)


@pytest.mark.parametrize("name", QUICKSTARTS)
def test_quickstart_validates_with_local_files_fast(local, name):
    cfg = _cfg(local, file=name)
    start = time.perf_counter()
    derived = validate(cfg)
    assert time.perf_counter() - start < 1.0
    assert derived.role_world["actor"] == 2
    if name.startswith("ppo"):  # a TP2 actor, a DP2 critic
        assert derived.roles == ("actor", "ref", "critic") and derived.role_dp["critic"] == 2
        assert derived.role_dp["actor"] == 1
    else:  # GRPO: a DP2 actor
        assert derived.roles == ("actor",) and derived.role_dp["actor"] == 2


def test_context_parallel_layout_validates_on_gpu_runs(local):
    derived = validate(_cfg(local, "resources.accelerator=gpu", "actor.layout.tp=1", "actor.layout.cp=2"))
    assert derived.role_dp["actor"] == 1  # 2 GPUs / (tp*pp*cp = 1*1*2)


def test_derived_sizes_of_the_moe_dapo_config_with_engine_servers():
    derived = derive(load_config(CONFIGS / "qwen3-30b-a3b_dapo_math.yaml"))
    assert derived.pool_gpus == {"main": 16, "rollout": 8} and derived.rollout_engines == 2  # vLLM TP4 servers
    assert derived.role_dp["actor"] == 8 and derived.updates_per_step["actor"] == 4


def test_derived_sizes_of_the_70b_config():
    derived = derive(load_config(CONFIGS / "llama3-70b_ppo.yaml"))
    assert derived.role_world["actor"] == 64 and derived.role_dp["actor"] == 2  # TP8 x PP4
    assert derived.samples_per_step == 256 * 4
    assert derived.updates_per_step["actor"] == 4 and derived.samples_per_update["actor"] == 64 * 4
    assert derived.rollout_engines == 8


BAD = [
    # batch arithmetic: which numbers do not divide
    (
        [
            "resources.gpus_per_node=8",
            "actor.layout.tp=1",
            "trainer.prompts_per_step=3",
            "rollout.samples_per_prompt=2",
        ],
        r"trainer\.prompts_per_step \* rollout\.samples_per_prompt = 3 \* 2 = 6\) is not divisible by actor's"
        r" data-parallel size 8",
    ),
    (["actor.prompts_per_update=3"], r"actor\.prompts_per_update=3 does not divide trainer\.prompts_per_step=32"),
    (
        ["actor.layout.tp=1", "actor.prompts_per_update=1", "rollout.samples_per_prompt=1"],
        r"samples per update \(actor\.prompts_per_update \* rollout\.samples_per_prompt = 1 \* 1 = 1\) is not"
        r" divisible by actor's data-parallel size 2",
    ),
    # layouts vs GPUs and vs the model
    (
        ["actor.layout.tp=2", "actor.layout.pp=3"],
        r"actor\.layout: tp\*pp\*cp = 2\*3\*1 = 6 does not divide the 2 GPUs of pool 'main'",
    ),
    (
        ["resources.gpus_per_node=8", "actor.layout.tp=8"],
        r"actor\.layout does not fit .*num_attention_heads=4 is not divisible by tp=8",
    ),
    (["resources.gpus_per_node=4", "actor.layout.tp=4"], r"num_key_value_heads=2 is not divisible by tp=4"),
    (
        ["resources.gpus_per_node=4", "actor.layout.tp=1", "actor.layout.pp=4"],
        r"num_hidden_layers=2 is not divisible by pp\*vpp",
    ),
    (["actor.layout.tp=4"], r"actor\.layout\.tp=4 > resources\.gpus_per_node=2"),
    (
        ["actor.layout.tp=1", "actor.layout.cp=2"],
        r"actor\.layout\.cp=2 needs Transformer Engine attention on GPUs, but"
        r" resources\.accelerator='cpu'; set actor\.layout\.cp=1",
    ),
    (["rollout.tp=8", "resources.gpus_per_node=8"], r"rollout\.tp=8 does not fit the model's num_attention_heads=4"),
    (["resources.pools={main: 3}"], r"resources\.pools asks for 3 GPUs .* = 1 \* 2 = 2"),
    (["rollout.mode=server"], r"rollout\.mode=server needs its own pool"),
    (["rollout.delta_weights=true"], r"rollout\.delta_weights=true needs rollout\.mode=server"),
    (["rollout.sync_bucket_mb=0"], r"rollout\.sync_bucket_mb=0 must be >= 1 \(MiB\)"),
    (
        [
            "resources.gpus_per_node=4",
            "resources.pools={main: 2, rollout: 2}",
            "rollout.mode=server",
            "rollout.pool=rollout",
            "critic.enabled=true",
            "critic.pool=rollout",
        ],
        r"pool 'rollout' holds the engine servers, but critic\.pool is 'rollout' too",
    ),
    (
        [
            "resources.gpus_per_node=4",
            "resources.pools={main: 1, rollout: 3}",
            "rollout.mode=server",
            "rollout.pool=rollout",
            "rollout.tp=2",
            "actor.layout.tp=1",
        ],
        r"rollout\.tp=2 does not divide the 3 GPUs per node of pool 'rollout'",
    ),
    (["critic.enabled=true", "critic.pool=spare"], r"critic\.pool='spare' is not a pool; pools: \['main'\]"),
    # algorithm names and combinations
    (
        ["algorithm.advantage.estimator=grpp"],
        r"algorithm\.advantage\.estimator: unknown advantage estimator 'grpp';"
        r" valid names: dr_grpo, gae, grpo",
    ),
    (
        ["algorithm.policy_loss.name=ppo"],
        r"algorithm\.policy_loss\.name: unknown policy loss 'ppo'; valid names: cispo, decoupled_ppo, gspo, ppo_clip",
    ),
    (["algorithm.loss_agg_mode=mean"], r"algorithm\.loss_agg_mode: unknown loss aggregation 'mean'"),
    (["algorithm.kl_loss.estimator=k9"], r"algorithm\.kl_loss\.estimator: unknown KL estimator 'k9'"),
    (
        ["algorithm.advantage.estimator=gae"],
        r"estimator='gae' needs critic values but critic\.enabled is false; set critic\.enabled=true",
    ),
    (
        ["rollout.samples_per_prompt=1"],
        r"estimator='grpo' compares the samples of each prompt, but"
        r" rollout\.samples_per_prompt=1 makes groups of one, whose advantages are all 0",
    ),
    (["rollout.samples_per_prompt=1", "algorithm.advantage.estimator=rloo"], r"estimator='rloo' compares the samples"),
    (["algorithm.kl_loss.coef=0.1", "ref.enabled=false"], r"a KL term is on .* ref\.enabled=false"),
    (["reward.reward_fn=no_such_reward"], r"reward\.reward_fn: unknown reward 'no_such_reward'"),
    (
        ["algorithm.critic_warmup_steps=300"],
        r"algorithm\.critic_warmup_steps=300 must be in \[0, trainer\.total_steps=100\)",
    ),
    # files and lengths
    (["data.files=[nowhere/train.parquet]"], r"data\.files: 'nowhere/train\.parquet' does not exist"),
    (["model.hf_path=nowhere"], r"model\.hf_path='nowhere' has no config\.json"),
    (["rollout.max_response_tokens=500"], r"16 \+ 500 = 516 must fit .* max_position_embeddings=256"),
    (["trainer.loggers=[console, mlflow]"], r"trainer\.loggers=.*valid loggers are console, jsonl, tensorboard, wandb"),
    (["rollout.engine=sglang"], r"rollout\.engine='sglang'; pick one of auto, vllm, embedded"),
    (
        ["algorithm.dapo.overlong_buffer_len=4"],
        r"overlong_buffer_len=4 must be smaller than rollout\.max_response_tokens=4",
    ),
    (
        ["algorithm.dapo.filter_groups=true", "rollout.samples_per_prompt=1", "actor.layout.tp=2"],
        r"filter_groups=true .* rollout\.samples_per_prompt=1 makes groups of one",
    ),
    (["trainer.checkpoint_every_steps=-1"], r"trainer\.checkpoint_every_steps=-1 must be >= 0 \(0: off\)"),
    (["reward.batch_reward_fn=no_such_judge"], r"reward\.batch_reward_fn: unknown batch reward 'no_such_judge'"),
    # validation and evaluation
    (
        ["trainer.val_only=true", "validation.files=[]"],
        r"trainer\.val_only=true evaluates on validation\.files, which is"
        r" empty",
    ),
    (["validation.greedy=false", "validation.top_p=0"], r"validation\.top_p=0\.0 must be in \(0, 1\]"),
    (["validation.temperature=-1"], r"validation\.temperature=-1\.0 must be >= 0"),
    (["trainer.zero_variance_warn_steps=-1"], r"trainer\.zero_variance_warn_steps=-1 must be >= 0"),
]


def test_every_estimator_that_reads_group_ids_refuses_groups_of_one(local):
    """No silent zero-signal run: an estimator declaring `group_ids` (grpo, dr_grpo, rloo,
    reinforce_plus_plus_baseline, ...) with one sample per prompt gives all-zero advantages."""
    from megarl.algorithms import ADVANTAGE_ESTIMATORS, estimator_needs

    grouped = [name for name in ADVANTAGE_ESTIMATORS.names() if "group_ids" in estimator_needs(name)]
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"} <= set(grouped)
    for name in grouped:
        with pytest.raises(
            ConfigError,
            match=rf"estimator='{name}' compares the samples of each prompt, but"
            r" rollout\.samples_per_prompt=1 .* set rollout\.samples_per_prompt >= 2",
        ):
            validate(_cfg(local, f"algorithm.advantage.estimator={name}", "rollout.samples_per_prompt=1"))
        validate(_cfg(local, f"algorithm.advantage.estimator={name}", "rollout.samples_per_prompt=2"))


def test_reward_fn_and_batch_reward_fn_together_are_refused(local):
    with pytest.raises(ConfigError, match=r"set reward_fn \('arithmetic'\) or batch_reward_fn"):
        validate(_cfg(local, "reward.reward_fn=arithmetic", "reward.batch_reward_fn=some.module:judge"))


def test_estimator_needs_are_checked_without_running_the_estimator(local, tmp_path):
    from megarl.algorithms import estimator_needs

    assert estimator_needs("gae") == ("values",) and estimator_needs("grpo") == ("group_ids",)
    assert estimator_needs("remax") == ("baseline_rewards",) and estimator_needs("reinforce_plus_plus") == ()
    validate(_cfg(local, "algorithm.advantage.estimator=remax"))  # the loop generates the greedy baseline
    validate(_cfg(local, "algorithm.advantage.estimator=reinforce_plus_plus", "rollout.samples_per_prompt=1"))
    user = tmp_path / "my_estimator.py"
    user.write_text("def adv(inputs, cfg):\n    return inputs.values, inputs.values\n\nadv.needs = ('values',)\n")
    with pytest.raises(ConfigError, match=r"my_estimator\.py:adv' needs critic values"):
        validate(_cfg(local, f"algorithm.advantage.estimator={user}:adv"))


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_config_fails_naming_the_field(local, overrides, message):
    cfg = _cfg(local, *overrides)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    assert time.perf_counter() - start < 1.0


def test_dataset_columns_and_tokenizer_are_checked_up_front(local):
    with pytest.raises(
        ConfigError,
        match=r"data\.files: '.*other\.jsonl' has no column 'prompt' \(data\.prompt_key='prompt'\);"
        r" columns: \['question', 'answer'\]",
    ):
        validate(_cfg(local, f"data.files=[{local['root']}/other.jsonl]"))
    other = f"[{local['root']}/other.jsonl]"
    assert validate(
        _cfg(
            local,
            f"data.files={other}",
            f"validation.files={other}",
            "data.prompt_key=question",
            "data.ground_truth_key=answer",
        )
    )
    with pytest.raises(ConfigError, match=r"no tokenizer in '.*bare'.*set model\.tokenizer_path"):
        validate(_cfg(local, f"model.hf_path={local['root']}/bare"))
    assert validate(_cfg(local, f"model.hf_path={local['root']}/bare", f"model.tokenizer_path={local['model']}"))


def test_ppo_needs_a_critic_and_gets_a_ref_for_the_kl_reward(local):
    derived = validate(
        _cfg(local, "algorithm.advantage.estimator=gae", "critic.enabled=true", "algorithm.kl_reward.coef=0.05")
    )
    assert derived.roles == ("actor", "ref", "critic")
    assert validate(_cfg(local)).roles == ("actor",)  # GRPO without KL: no ref, no critic


def test_rollout_server_pool(local):
    derived = validate(
        _cfg(
            local,
            "resources.gpus_per_node=4",
            "resources.pools={main: 2, rollout: 2}",
            "rollout.mode=server",
            "rollout.pool=rollout",
            "rollout.tp=1",
        )
    )
    assert derived.pool_gpus == {"main": 2, "rollout": 2} and derived.rollout_engines == 2


SERVER = [
    "resources.gpus_per_node=3",
    "resources.pools={main: 2, rollout: 1}",
    "rollout.mode=server",
    "rollout.pool=rollout",
]


def test_async_with_colocated_engines_is_refused_naming_the_server_fix(local):
    with pytest.raises(ConfigError, match=r"trainer\.mode=async .*colocated.*rollout\.mode=server.*rollout\.pool"):
        validate(_cfg(local, "trainer.mode=async"), check_paths=False)
    derived = validate(_cfg(local, "trainer.mode=async", *SERVER), check_paths=False)
    assert derived.rollout_engines == 1


@pytest.mark.parametrize(
    "override, match",
    [
        ("trainer.mode=overlap", r"trainer\.mode='overlap'; pick one of sync, async"),
        ("async_training.max_staleness=-1", r"async_training\.max_staleness=-1 must be >= 0"),
        ("async_training.over_stale=skip", r"async_training\.over_stale='skip'; pick one of pace, drop"),
        ("async_training.on_update=wait", r"async_training\.on_update='wait'; pick one of continue, abort"),
        ("async_training.max_concurrent_rollouts=2", r"max_concurrent_rollouts=2 is below one prompt's"),
        ("algorithm.dapo.filter_groups=true", r"trainer\.mode=async does not support algorithm\.dapo\.filter_groups"),
    ],
)
def test_bad_async_settings_are_refused_naming_the_field(local, override, match):
    with pytest.raises(ConfigError, match=match):
        validate(
            _cfg(local, "trainer.mode=async", "rollout.samples_per_prompt=4", *SERVER, override), check_paths=False
        )
