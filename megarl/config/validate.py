"""Up-front checks of a `RunConfig`, and the one place derived sizes are computed.

Owns: `derive(cfg) -> Derived` (active roles, GPUs per pool, each role's DP size, samples per step
and per update, updates per step, rollout engines) and `validate(cfg, check_paths=True)`, which
runs in well under a second before any worker starts. Every error is a `ConfigError` that names
the field(s) and the fix: sizes that do not divide (saying which numbers), layouts that do not fit
the model's heads/layers, unknown algorithm names (listing the valid ones), missing files, GPU
counts against layouts, an estimator that needs a critic without one.

`check_paths=False` skips what needs local files (the HF config.json, dataset and tokenizer
files): for configs written on a laptop for a cluster whose paths only exist there; those checks
live in `megarl.config.files`. Imports no megatron, vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.files import check_files, check_layouts_fit, check_models, resolve_max_model_len
from megarl.config.loader import ConfigError
from megarl.config.modes import check_agent, check_async
from megarl.config.schema import (
    ACCELERATORS,
    LOGGERS,
    MAIN_POOL,
    ROLLOUT_ENGINES,
    ROLLOUT_MODES,
    RoleConfig,
    RunConfig,
    TrainableRoleConfig,
)

MODEL_ROLES = ("actor", "ref", "critic", "reward_model")
TRAINABLE_ROLES = ("actor", "critic")


@dataclass(frozen=True)
class Derived:
    """Sizes that follow from the config (computed here only; the trainer reads them from here)."""

    roles: tuple[str, ...]
    """Active model roles, in build order (actor first)."""
    pool_gpus: dict[str, int]
    """GPUs (workers) per resource pool."""
    role_world: dict[str, int]
    """Ranks each active role spans (its whole pool)."""
    role_dp: dict[str, int]
    """Data-parallel size of each active role."""
    samples_per_step: int
    """prompts_per_step * samples_per_prompt."""
    samples_per_update: dict[str, int] = field(default_factory=dict)
    """Samples per optimizer step of each trainable role."""
    updates_per_step: dict[str, int] = field(default_factory=dict)
    """Optimizer steps per RL step of each trainable role (epochs included)."""
    rollout_engines: int = 1
    """Rollout engine instances (rollout pool GPUs / rollout.tp)."""


# ----------------------------------------------------------------------------- which roles exist


def kl_enabled(cfg: RunConfig) -> bool:
    """A KL term (in the reward or in the loss) is on."""
    return cfg.algorithm.kl_reward.coef > 0 or cfg.algorithm.kl_loss.coef > 0


def active_roles(cfg: RunConfig) -> tuple[str, ...]:
    """The model roles this config builds: the actor always; ref, critic, reward model when enabled."""
    ref = kl_enabled(cfg) if cfg.ref.enabled is None else cfg.ref.enabled
    on = {"actor": True, "ref": ref, "critic": cfg.critic.enabled, "reward_model": cfg.reward_model.enabled}
    return tuple(role for role in MODEL_ROLES if on[role])


def pool_sizes(cfg: RunConfig) -> dict[str, int]:
    """GPUs per pool: resources.pools, or one pool 'main' with every GPU."""
    res = cfg.resources
    total = res.nodes * res.gpus_per_node
    pools = dict(res.pools) or {MAIN_POOL: total}
    used = sum(pools.values())
    if used > total:
        raise ConfigError(
            f"resources.pools asks for {used} GPUs ({pools}) but resources.nodes *"
            f" resources.gpus_per_node = {res.nodes} * {res.gpus_per_node} = {total}; shrink the"
            " pools or add nodes"
        )
    for name, gpus in pools.items():
        if gpus < 1:
            raise ConfigError(f"resources.pools.{name}={gpus}: a pool needs at least one GPU")
        if gpus > res.gpus_per_node and gpus % res.gpus_per_node:
            raise ConfigError(
                f"resources.pools.{name}={gpus} spans nodes but is not a multiple of"
                f" resources.gpus_per_node={res.gpus_per_node}; pools are made of whole nodes"
            )
    return pools


# ----------------------------------------------------------------------------- derived sizes


def derive(cfg: RunConfig) -> Derived:
    """Every derived size, checked: raises `ConfigError` saying which numbers do not divide."""
    pools = pool_sizes(cfg)
    roles = active_roles(cfg)
    role_world, role_dp = {}, {}
    for role in roles:
        role_cfg: RoleConfig = getattr(cfg, role)
        role_world[role] = _pool_of(pools, role_cfg.pool, f"{role}.pool")
        role_dp[role] = _dp_size(role, role_cfg, role_world[role], cfg.resources.gpus_per_node)
    samples = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
    for role in roles:
        if samples % role_dp[role]:
            raise ConfigError(
                _indivisible(
                    cfg,
                    f"samples per step (trainer.prompts_per_step *"
                    f" rollout.samples_per_prompt = {cfg.trainer.prompts_per_step} *"
                    f" {cfg.rollout.samples_per_prompt} = {samples})",
                    role,
                    role_dp[role],
                    role_world[role],
                )
            )
    per_update, updates = {}, {}
    for role in (r for r in roles if r in TRAINABLE_ROLES):
        per_update[role], updates[role] = _updates(cfg, role, role_dp[role], role_world[role])
    return Derived(
        roles=roles,
        pool_gpus=pools,
        role_world=role_world,
        role_dp=role_dp,
        samples_per_step=samples,
        samples_per_update=per_update,
        updates_per_step=updates,
        rollout_engines=_engines(cfg, pools, roles),
    )


def _pool_of(pools: dict[str, int], name: str, where: str) -> int:
    if name not in pools:
        raise ConfigError(f"{where}={name!r} is not a pool; pools: {sorted(pools)} (set resources.pools)")
    return pools[name]


def _dp_size(role: str, role_cfg: RoleConfig, world: int, gpus_per_node: int) -> int:
    layout = role_cfg.layout
    if layout.tp > gpus_per_node:
        raise ConfigError(
            f"{role}.layout.tp={layout.tp} > resources.gpus_per_node={gpus_per_node}: tensor"
            " parallelism must stay inside a node; lower tp and raise pp instead"
        )
    if world % layout.model_parallel_size:
        raise ConfigError(
            f"{role}.layout: tp*pp*cp = {layout.tp}*{layout.pp}*{layout.cp} = {layout.model_parallel_size} does not"
            f" divide the {world} GPUs of pool {role_cfg.pool!r}; pick a layout whose tp*pp*cp divides {world}"
            " or resize the pool (resources.pools / resources.gpus_per_node)"
        )
    dp = world // layout.model_parallel_size
    if layout.ep > 1 and (dp * layout.cp) % layout.ep:
        raise ConfigError(f"{role}.layout.ep={layout.ep} must divide dp*cp = {dp}*{layout.cp}")
    return dp


def _indivisible(cfg: RunConfig, what: str, role: str, dp: int, world: int) -> str:
    layout = getattr(cfg, role).layout
    return (
        f"{what} is not divisible by {role}'s data-parallel size {dp} (= {world} GPUs /"
        f" (tp*pp*cp = {layout.model_parallel_size})); change trainer.prompts_per_step or"
        f" rollout.samples_per_prompt so that it divides, or the {role} layout"
    )


def _updates(cfg: RunConfig, role: str, dp: int, world: int) -> tuple[int, int]:
    role_cfg: TrainableRoleConfig = getattr(cfg, role)
    prompts = cfg.trainer.prompts_per_step
    per_update = role_cfg.prompts_per_update or prompts
    if per_update < 1 or prompts % per_update:
        raise ConfigError(
            f"{role}.prompts_per_update={per_update} does not divide trainer.prompts_per_step="
            f"{prompts}; pick a divisor of {prompts} (or null for one update per step)"
        )
    samples = per_update * cfg.rollout.samples_per_prompt
    if samples % dp:
        raise ConfigError(
            _indivisible(
                cfg,
                f"samples per update ({role}.prompts_per_update *"
                f" rollout.samples_per_prompt = {per_update} *"
                f" {cfg.rollout.samples_per_prompt} = {samples})",
                role,
                dp,
                world,
            )
        )
    if role_cfg.epochs_per_step < 1:
        raise ConfigError(f"{role}.epochs_per_step={role_cfg.epochs_per_step} must be >= 1")
    return samples, role_cfg.epochs_per_step * (prompts // per_update)


def _engines(cfg: RunConfig, pools: dict[str, int], roles: tuple[str, ...]) -> int:
    ro = cfg.rollout
    if ro.mode not in ROLLOUT_MODES:
        raise ConfigError(f"rollout.mode={ro.mode!r}; pick one of {', '.join(ROLLOUT_MODES)}")
    gpus = _pool_of(pools, ro.pool, "rollout.pool")
    if ro.mode == "colocated" and ro.pool != cfg.actor.pool:
        raise ConfigError(
            f"rollout.mode=colocated needs rollout.pool == actor.pool ({ro.pool!r} vs"
            f" {cfg.actor.pool!r}); set rollout.pool={cfg.actor.pool} or rollout.mode=server"
        )
    if ro.mode == "server" and ro.pool == cfg.actor.pool:
        raise ConfigError(
            f"rollout.mode=server needs its own pool, not the actor's ({ro.pool!r}); add one to"
            " resources.pools and set rollout.pool, or use rollout.mode=colocated"
        )
    if ro.delta_weights and ro.mode != "server":
        raise ConfigError(
            "rollout.delta_weights=true needs rollout.mode=server (deltas travel on the broadcast to engine"
            " servers; colocated engines take the weights in memory); set it false or use rollout.mode=server"
        )
    shared = [r for r in roles if ro.mode == "server" and getattr(cfg, r).pool == ro.pool]
    if shared:
        raise ConfigError(
            f"rollout.mode=server: pool {ro.pool!r} holds the engine servers, but {shared[0]}.pool"
            f" is {ro.pool!r} too; put the model roles on another pool"
        )
    per_node = min(gpus, cfg.resources.gpus_per_node)
    if ro.tp < 1 or per_node % ro.tp:
        raise ConfigError(
            f"rollout.tp={ro.tp} does not divide the {per_node} GPUs per node of pool {ro.pool!r};"
            f" pick a divisor of {per_node} (an engine stays inside a node)"
        )
    return gpus // ro.tp


# ----------------------------------------------------------------------------- validate


def validate(cfg: RunConfig, *, check_paths: bool = True) -> Derived:
    """Check everything that can be checked before a worker starts; the derived sizes, or `ConfigError`.

    check_paths=False skips the checks that read local files (HF config.json, data, tokenizer).
    """
    _check_ranges(cfg)
    check_async(cfg)
    _check_algorithm(cfg)
    check_agent(cfg, check_paths)
    derived = derive(cfg)
    _check_roles(cfg, derived)
    if check_paths:
        check_files(cfg)
        check_models(cfg, derived.roles)
    return derived


def _check_ranges(cfg: RunConfig) -> None:
    tr, ro, res = cfg.trainer, cfg.rollout, cfg.resources
    rules = [
        (tr.total_steps >= 1, f"trainer.total_steps={tr.total_steps} must be >= 1"),
        (tr.prompts_per_step >= 1, f"trainer.prompts_per_step={tr.prompts_per_step} must be >= 1"),
        *[
            (value >= 0, f"{name}={value} must be >= 0 (0: off)")
            for name, value in (
                ("trainer.checkpoint_every_steps", tr.checkpoint_every_steps),
                ("trainer.keep_checkpoints", tr.keep_checkpoints),
                ("trainer.dump_rollouts_every_steps", tr.dump_rollouts_every_steps),
                ("validation.every_steps", cfg.validation.every_steps),
            )
        ],
        (tr.log_every_steps >= 1, f"trainer.log_every_steps={tr.log_every_steps} must be >= 1"),
        (bool(tr.resume), "trainer.resume is empty: use auto, never, or a checkpoint path"),
        (set(tr.loggers) <= set(LOGGERS), f"trainer.loggers={tr.loggers}: valid loggers are {', '.join(LOGGERS)}"),
        (ro.samples_per_prompt >= 1, f"rollout.samples_per_prompt={ro.samples_per_prompt} must be >= 1"),
        (ro.max_response_tokens >= 1, f"rollout.max_response_tokens={ro.max_response_tokens} must be >= 1"),
        (ro.sync_bucket_mb >= 1, f"rollout.sync_bucket_mb={ro.sync_bucket_mb} must be >= 1 (MiB)"),
        (ro.engine in ROLLOUT_ENGINES, f"rollout.engine={ro.engine!r}; pick one of {', '.join(ROLLOUT_ENGINES)}"),
        (
            ro.temperature >= 0 and 0 < ro.top_p <= 1,
            f"rollout.temperature={ro.temperature} must be >= 0 and rollout.top_p={ro.top_p} in (0, 1]",
        ),
        (
            0 < ro.gpu_memory_utilization <= 1,
            f"rollout.gpu_memory_utilization={ro.gpu_memory_utilization} must be in (0, 1]",
        ),
        (res.accelerator in ACCELERATORS, f"resources.accelerator={res.accelerator!r}; pick gpu or cpu"),
        (
            res.nodes >= 1 and res.gpus_per_node >= 1,
            f"resources.nodes={res.nodes} and resources.gpus_per_node={res.gpus_per_node} must be >= 1",
        ),
        (
            cfg.validation.samples_per_prompt >= 1,
            f"validation.samples_per_prompt={cfg.validation.samples_per_prompt} must be >= 1",
        ),
        *_validation_sampling_rules(cfg.validation),
        (
            not tr.val_only or bool(cfg.validation.files),
            "trainer.val_only=true evaluates on validation.files, which is empty; list the evaluation prompt files",
        ),
        (
            tr.zero_variance_warn_steps >= 0,
            f"trainer.zero_variance_warn_steps={tr.zero_variance_warn_steps} must be >= 0 (0: never warn)",
        ),
        (
            cfg.algorithm.dapo.overlong_buffer_len < ro.max_response_tokens,
            f"algorithm.dapo.overlong_buffer_len={cfg.algorithm.dapo.overlong_buffer_len} must be smaller than"
            f" rollout.max_response_tokens={ro.max_response_tokens} (the penalty zone ends at the limit)",
        ),
        (
            not cfg.algorithm.dapo.filter_groups or ro.samples_per_prompt >= 2,
            "algorithm.dapo.filter_groups=true keeps groups whose rewards differ, but rollout.samples_per_prompt=1"
            " makes groups of one; raise rollout.samples_per_prompt or turn filter_groups off",
        ),
        (
            cfg.algorithm.dapo.max_generations >= 1,
            f"algorithm.dapo.max_generations={cfg.algorithm.dapo.max_generations} must be >= 1",
        ),
        (bool(cfg.model.hf_path), "model.hf_path is empty: set it to the initial policy's HF checkpoint directory"),
        (bool(cfg.data.files), "data.files is empty: list the training prompt files (parquet/jsonl/json)"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def _validation_sampling_rules(val) -> list[tuple[bool, str]]:
    """validation.temperature / top_p / top_k (None: the rollout's) in range when set."""
    return [
        (
            val.temperature is None or val.temperature >= 0,
            f"validation.temperature={val.temperature} must be >= 0 (or null: rollout.temperature)",
        ),
        (
            val.top_p is None or 0 < val.top_p <= 1,
            f"validation.top_p={val.top_p} must be in (0, 1] (or null: rollout.top_p)",
        ),
        (
            val.top_k is None or val.top_k >= 0,
            f"validation.top_k={val.top_k} must be >= 0 (0: off; null: rollout.top_k)",
        ),
    ]


def _check_algorithm(cfg: RunConfig) -> None:
    from megarl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
    from megarl.algorithms.mismatch import IS_LEVELS

    alg = cfg.algorithm
    lookups = [
        ("algorithm.advantage.estimator", ADVANTAGE_ESTIMATORS, alg.advantage.estimator),
        ("algorithm.policy_loss.name", POLICY_LOSSES, alg.policy_loss.name),
        ("algorithm.loss_agg_mode", LOSS_AGGREGATIONS, alg.loss_agg_mode),
        ("algorithm.kl_reward.estimator", KL_ESTIMATORS, alg.kl_reward.estimator),
        ("algorithm.kl_loss.estimator", KL_ESTIMATORS, alg.kl_loss.estimator),
    ]
    if alg.mismatch.level is not None:
        lookups.append(("algorithm.mismatch.level", IS_LEVELS, alg.mismatch.level))
    for where, registry, name in lookups:
        try:
            registry.get(name)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {err}") from None
    _check_reward_fns(cfg)
    if alg.critic_warmup_steps < 0 or alg.critic_warmup_steps >= cfg.trainer.total_steps:
        raise ConfigError(
            f"algorithm.critic_warmup_steps={alg.critic_warmup_steps} must be in [0,"
            f" trainer.total_steps={cfg.trainer.total_steps}) or the actor never trains"
        )


def _check_reward_fns(cfg: RunConfig) -> None:
    """reward.reward_fn / reward.batch_reward_fn resolve (registered name or loadable dotted path)."""
    from megarl.rewards import get_batch_reward_fn, get_reward_fn

    for where, name, lookup in (
        ("reward.reward_fn", cfg.reward.reward_fn, get_reward_fn),
        ("reward.batch_reward_fn", cfg.reward.batch_reward_fn, get_batch_reward_fn),
    ):
        if name is None:
            continue
        try:
            lookup(name)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {err}") from None


def _check_estimator_needs(cfg: RunConfig, derived: Derived) -> None:
    """What the advantage estimator declares it reads, against the run (nothing is run to find out)."""
    from megarl.algorithms import estimator_needs

    estimator = cfg.algorithm.advantage.estimator
    needs = estimator_needs(estimator)
    if "values" in needs and "critic" not in derived.roles:
        raise ConfigError(
            f"algorithm.advantage.estimator={estimator!r} needs critic values but critic.enabled"
            " is false; set critic.enabled=true (PPO) or pick an estimator without a critic"
            " (grpo, rloo, reinforce_plus_plus, ...)"
        )
    if "group_ids" in needs and cfg.rollout.samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.advantage.estimator={estimator!r} compares the samples of each prompt, but"
            " rollout.samples_per_prompt=1 makes groups of one, whose advantages are all 0 (no"
            " signal); set rollout.samples_per_prompt >= 2, or pick an estimator without groups"
            " (reinforce_plus_plus, remax, or gae with a critic)"
        )
    # "baseline_rewards" (remax): the loop generates the greedy baseline itself (RLTrainer.baseline_scores)


def _check_roles(cfg: RunConfig, derived: Derived) -> None:
    _check_estimator_needs(cfg, derived)
    if kl_enabled(cfg) and "ref" not in derived.roles:
        raise ConfigError(
            "a KL term is on (algorithm.kl_reward.coef or algorithm.kl_loss.coef > 0) but"
            " ref.enabled=false; set ref.enabled=true (or null) or the KL coefs to 0"
        )
    if cfg.reward_model.enabled and not cfg.reward_model.hf_path:
        raise ConfigError("reward_model.enabled=true needs reward_model.hf_path (the reward model checkpoint)")
    if cfg.algorithm.critic_warmup_steps and "critic" not in derived.roles:
        raise ConfigError(
            "algorithm.critic_warmup_steps > 0 needs a critic; set critic.enabled=true or the warm-up to 0"
        )
    _check_context_parallel(cfg, derived)


def _check_context_parallel(cfg: RunConfig, derived: Derived) -> None:
    """cp > 1 runs only with Transformer Engine attention (GPU): refuse it on CPU runs here; on GPU runs
    each engine checks that TE imports on its worker (`engine.check_context_parallel`)."""
    if cfg.resources.accelerator == "gpu":
        return
    for role in derived.roles:
        cp = getattr(cfg, role).layout.cp
        if cp > 1:
            raise ConfigError(
                f"{role}.layout.cp={cp} needs Transformer Engine attention on GPUs, but"
                f" resources.accelerator={cfg.resources.accelerator!r}; set {role}.layout.cp=1"
                " (or run on GPUs with transformer_engine installed)"
            )


# ----------------------------------------------------------------------------- local files


def describe(derived: Derived) -> str:
    """One line of derived sizes for logs and `megarl config`."""
    dps = ", ".join(f"{r} dp={derived.role_dp[r]}/{derived.role_world[r]} GPUs" for r in derived.roles)
    ups = ", ".join(
        f"{r} {n} updates x {derived.samples_per_update[r]} samples" for r, n in derived.updates_per_step.items()
    )
    return f"roles: {dps}; {derived.samples_per_step} samples/step; {ups}; {derived.rollout_engines} rollout engine(s)"


__all__ = [
    "Derived",
    "active_roles",
    "check_layouts_fit",
    "derive",
    "describe",
    "kl_enabled",
    "pool_sizes",
    "resolve_max_model_len",
    "validate",
]
