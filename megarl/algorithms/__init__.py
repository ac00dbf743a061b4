"""RL algorithms as plain functions: advantage estimators, policy/value losses, KL, loss
aggregation, rollout/train mismatch correction and DAPO pieces.

Each kind lives in a registry whose members share one signature:

    get_advantage_estimator(name)(inputs: AdvantageInputs, cfg: AdvantageConfig) -> (advantages, returns)
        (estimator_needs(name): the optional inputs it reads — values, group_ids, baseline_rewards)
    get_policy_loss(name)(inputs: PolicyLossInputs, cfg: PolicyLossConfig, agg: LossAggregation)
        -> (loss, stats)
    get_kl_estimator(name)(log_probs, ref_log_probs) -> kl [B, T]
    LOSS_AGGREGATIONS.get(mode)(loss_mat, mask, agg) -> scalar

Names may also be dotted paths "pkg.module:fn" to user functions. This package imports only
torch and numpy: never megatron, vLLM or Ray (it must import on a CPU-only machine).
"""

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_NEEDS,
    AdvantageConfig,
    AdvantageInputs,
    estimator_needs,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megarl.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    loss_denominators,
    register_loss_aggregation,
)
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    make_kl_controller,
    register_kl_estimator,
)
from megarl.algorithms.mismatch import MismatchConfig, mismatch_metrics, truncated_is_weights
from megarl.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    entropy_bonus,
    entropy_from_logits,
    get_policy_loss,
    register_policy_loss,
)
from megarl.algorithms.value_loss import ValueLossConfig, ValueLossInputs, value_loss
