"""The typed run configuration: dataclasses with every default in code, thin YAML, checked up front.

    schema.py    RunConfig and its sections (trainer, model, data, validation, actor, critic, ref,
                 reward_model, reward, rollout, algorithm, resources)
    loader.py    load_config(files, overrides), on OmegaConf: defaults (OmegaConf.structured of the
                 dataclasses) ← YAML (with `defaults:` chains) ← dot-list overrides, then `${...}`
                 interpolation (`${trainer.prompts_per_step}`, `${oc.env:VAR,default}`) resolved over
                 all of them; unknown keys / wrong types / bad interpolations fail naming the field;
                 save_resolved (values, never `${...}`), to_dict
    validate.py  derive(cfg) (the one place derived sizes are computed) and validate(cfg) (sizes that
                 do not divide, layouts vs heads, algorithm names, files, GPUs vs layouts)

Typical use:

    cfg = load_config("configs/grpo_quickstart.yaml", ["actor.optim.lr=1e-6", "critic.optim.lr=${actor.optim.lr}"])
    derived = validate(cfg)            # ConfigError naming the field and the fix
    save_resolved(cfg, cfg.trainer.run_dir)

Imports torch (via megarl.algorithms), OmegaConf and PyYAML; never megatron, vLLM or Ray.
"""

from megarl.config.loader import (
    ConfigError,
    build,
    dump_yaml,
    field_docs,
    load_config,
    merge,
    parse_override,
    read_yaml_chain,
    save_resolved,
    to_dict,
)
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    ModelConfig,
    RefConfig,
    ResourceConfig,
    RewardModelConfig,
    RoleConfig,
    RolloutConfig,
    RunConfig,
    TrainableRoleConfig,
    TrainerConfig,
    ValidationConfig,
)
from megarl.config.validate import Derived, active_roles, derive, describe, kl_enabled, validate

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "Derived",
    "ModelConfig",
    "RefConfig",
    "ResourceConfig",
    "RewardModelConfig",
    "RoleConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainableRoleConfig",
    "TrainerConfig",
    "ValidationConfig",
    "active_roles",
    "build",
    "derive",
    "describe",
    "dump_yaml",
    "field_docs",
    "kl_enabled",
    "load_config",
    "merge",
    "parse_override",
    "read_yaml_chain",
    "save_resolved",
    "to_dict",
    "validate",
]
