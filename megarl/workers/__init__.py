"""The roles, one class each, built inside the Ray worker processes.

    Actor         megarl.workers.actor         policy log-probs + entropy, PPO/GRPO updates
    Reference     megarl.workers.reference     frozen policy log-probs (KL terms)
    Critic        megarl.workers.critic        values, clipped value-loss updates
    RewardModel   megarl.workers.reward_model  model scores of responses
    Rollout       megarl.workers.rollout       colocated engine fed by the actor's sharding manager
    RolloutSender megarl.workers.rollout       server mode: gathers and broadcasts the actor's weights

A model role owns its Megatron engine (on its own process groups), its head and, when it trains,
its loss; it names the batch columns it writes (`megarl.data.schema`). The methods the driver may
call carry `@remote(...)` (`megarl.utils.remote`), which says how rows reach the ranks; the driver
calls them through typed handles (`cluster.actor.compute_log_probs(batch)`,
`megarl.controller.cluster`). Every role is built by `Role.from_config(cfg, first=...)` in every
process of its pool, in the same order (creating process groups is collective); `first` marks the
first engine of a process (it seeds megatron's global state). `megarl.workers.base` holds what they
share: `ProcessSetup`, `EngineRole` (the call boundary: device mode + offload residency; checkpoints),
`build_engine`, `local_role`.

Imports megatron, vLLM and torch.distributed only inside the worker processes (lazily); never Ray.
"""

from megarl.workers.actor import Actor, ActorLossConfig, actor_loss
from megarl.workers.base import EngineRole, ProcessSetup, build_engine, local_role
from megarl.workers.critic import Critic, critic_loss
from megarl.workers.reference import Reference
from megarl.workers.reward_model import RewardModel
from megarl.workers.rollout import Rollout, RolloutSender, engine_spec

MODEL_ROLES = {"actor": Actor, "ref": Reference, "critic": Critic, "reward_model": RewardModel}
"""The model roles by config section name, in build order."""

__all__ = [
    "MODEL_ROLES",
    "Actor",
    "ActorLossConfig",
    "Critic",
    "EngineRole",
    "ProcessSetup",
    "Reference",
    "RewardModel",
    "Rollout",
    "RolloutSender",
    "actor_loss",
    "build_engine",
    "critic_loss",
    "engine_spec",
    "local_role",
]
