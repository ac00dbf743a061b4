"""`megarl plan --search`: every valid layout of a run for its GPU count, ranked by predicted step time.

Owns: `search(cfg, dims, gpu)`. Candidates: TP (divisors of gpus_per_node), PP (up to 16), EP
(MoE: divisors of the experts up to 64), rollout TP, and recompute on/off; every model role in the
actor's pool gets the same layout (roles on other pools keep theirs). A candidate is valid when the
config validation accepts it — `derive` (pools, DP, batch divisibility) and `check_layouts_fit`
(heads, layers, experts, rollout TP) — the same rules, not a copy of them. Valid candidates are
planned; those predicted to fit are ranked by step time, the rest by margin.
Imports megarl.config and megarl.plan; never megatron, vLLM or Ray.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate import TRAINABLE_ROLES, active_roles, check_layouts_fit
from megarl.models.hf_config import ModelDims
from megarl.models.layout import LayoutError, ParallelLayout
from megarl.plan.hardware import GPUSpec
from megarl.plan.planner import Assumptions, Plan, plan_run


@dataclass
class Candidate:
    """One layout choice and its plan."""

    tp: int
    pp: int
    ep: int
    rollout_tp: int
    recompute: bool
    plan: Plan
    config: RunConfig
    """The run config with this layout applied (what `megarl train` would run)."""

    @property
    def name(self) -> str:
        return f"tp{self.tp} pp{self.pp} ep{self.ep} dp{self.plan.role_dp['actor']} | rollout tp{self.rollout_tp}" + (
            " | recompute" if self.recompute else ""
        )


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def apply_layout(cfg: RunConfig, tp: int, pp: int, ep: int, rollout_tp: int, recompute: bool) -> RunConfig:
    """A copy of `cfg` whose actor-pool roles use tp/pp/ep (cp, vpp 1), rollout.tp and recompute."""
    out = copy.copy(cfg)  # sections this function changes are replaced, never mutated
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep)
    for role in active_roles(cfg):
        role_cfg = getattr(cfg, role)
        if role_cfg.pool == cfg.actor.pool:
            extra = {"recompute": recompute} if role in TRAINABLE_ROLES else {}
            setattr(out, role, dataclasses.replace(role_cfg, layout=layout, **extra))
    out.rollout = dataclasses.replace(cfg.rollout, tp=rollout_tp)
    return out


def _valid(cfg: RunConfig, dims: ModelDims) -> bool:
    try:
        check_layouts_fit(cfg, {r: dims for r in active_roles(cfg)}, dims)
        return True
    except (ConfigError, LayoutError):
        return False


def search(cfg: RunConfig, dims: ModelDims, gpu: GPUSpec, assumptions: Assumptions = Assumptions()) -> list[Candidate]:
    """Every valid candidate, planned: fitting ones first by step time, then the others by margin."""
    per_node = cfg.resources.gpus_per_node
    tps = _divisors(per_node, per_node)
    pps = _divisors(dims.num_layers, 16)
    eps = _divisors(dims.num_experts, 64) if dims.moe else [1]
    found = []
    for tp, pp, ep, rtp, recompute in itertools.product(tps, pps, eps, tps, (False, True)):
        try:
            candidate_cfg = apply_layout(cfg, tp, pp, ep, rtp, recompute)
        except LayoutError:
            continue
        if not _valid(candidate_cfg, dims):
            continue
        try:
            plan = plan_run(candidate_cfg, dims, gpu, assumptions)
        except ConfigError:  # derive: GPUs or batch sizes do not divide for this layout
            continue
        found.append(Candidate(tp, pp, ep, rtp, recompute, plan, candidate_cfg))
    # fitting: fastest first (times within 0.1 s: the larger margin first); the rest: closest to fitting
    return sorted(
        found, key=lambda c: (not c.plan.fits, round(c.plan.step_time, 1) if c.plan.fits else 0, -c.plan.margin)
    )
