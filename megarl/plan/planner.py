"""The plan of a run: predicted memory per role and phase on each pool's GPUs, and time per phase.

Owns: `Assumptions` (MFU, response fill, host bandwidth), `Plan` and `plan_run(cfg, dims, gpu)`.
Memory per phase of a pool is what is on one GPU while that phase runs: the phase's own working
set, every role of the pool that is not offloaded (`<role>.offload`), and a colocated vLLM engine
(awake: its whole gpu_memory_utilization share; asleep: its context), plus the CUDA context of
the worker. Sizes come from `megarl.config.validate.derive` (DP sizes, samples per update,
engines) and `megarl.plan.memory`; times from FLOPs at an MFU (`benchmarks/train_step.py`
measures it), decode steps as a roofline (FLOPs vs HBM bytes per token), and the sync as bytes over
NVLink (colocated, model copy inside a node) or the network (server mode, or a copy across nodes).
Imports megarl.config and megarl.models; never megatron, vLLM or Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.config.schema import RunConfig
from megarl.config.validate import TRAINABLE_ROLES, derive, resolve_max_model_len
from megarl.models.hf_config import ModelDims
from megarl.plan.hardware import GPUSpec
from megarl.plan.memory import (
    CONTEXT_BYTES,
    VLLM_MAX_SEQS,
    VLLM_NON_TORCH_BYTES,
    RoleMemory,
    Shard,
    VLLMMemory,
    active_params,
    micro_batch_tokens,
    role_memory,
    sync_buffer_bytes,
    total_params,
    vllm_memory,
)

VALUE_HEAD_ROLES = ("critic", "reward_model")


@dataclass(frozen=True)
class Assumptions:
    """What the planner cannot know from the config."""

    mfu: float = 0.35
    """Model FLOPs utilisation of Megatron forward/backward (benchmarks/train_step.py prints it on CUDA)."""
    prompt_fill: float = 0.6
    """Mean prompt length / data.max_prompt_tokens."""
    response_fill: float = 0.6
    """Mean response length / rollout.max_response_tokens (a wave still lasts the longest response)."""
    host_bandwidth: float = 25e9
    """Bytes/s of an offload or onload (pinned host memory over PCIe)."""


@dataclass
class Plan:
    """Everything `megarl plan` prints for one configuration."""

    gpu: GPUSpec
    layouts: dict[str, str]
    """Role -> 'tp2 pp1 cp1 ep1 dp4' (and 'rollout' -> 'tp2 x4 engines')."""
    roles: dict[str, RoleMemory]
    vllm: VLLMMemory
    phases: dict[str, dict[str, int]]
    """Pool -> phase -> predicted bytes on one GPU of the pool."""
    times: dict[str, float]
    """Phase -> seconds per RL step."""
    sequences_needed: int
    """Sequences one engine is sent per step (its share of samples_per_step)."""
    role_dp: dict[str, int] = field(default_factory=dict)
    """Data-parallel size of each role (from `derive`)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def peak(self) -> dict[str, int]:
        """Pool -> its largest phase."""
        return {pool: max(phases.values()) for pool, phases in self.phases.items()}

    @property
    def margin(self) -> int:
        """HBM minus the largest phase of any pool (negative: predicted not to fit)."""
        return self.gpu.hbm_bytes - max(self.peak.values())

    @property
    def fits(self) -> bool:
        return self.margin >= 0 and self.vllm.sequences >= 1

    @property
    def step_time(self) -> float:
        return sum(self.times.values())


def _dtype_bytes(cfg: RunConfig, dtype: str) -> int:
    if dtype == "auto":
        return 2 if cfg.resources.accelerator == "gpu" else 4
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _lengths(cfg: RunConfig, a: Assumptions) -> tuple[int, float, float]:
    """(longest row, mean prompt, mean response) in tokens."""
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    return longest, a.prompt_fill * cfg.data.max_prompt_tokens, a.response_fill * cfg.rollout.max_response_tokens


def role_memories(cfg: RunConfig, dims: ModelDims, derived, a: Assumptions) -> tuple[dict, dict]:
    """Role -> RoleMemory on its most loaded GPU, and role -> layout text."""
    longest, prompt, response = _lengths(cfg, a)
    memories, layouts = {}, {}
    for role in derived.roles:
        role_cfg = getattr(cfg, role)
        shard = Shard.of(role_cfg.layout, derived.role_world[role])
        tokens = micro_batch_tokens(role_cfg, longest)
        trainable = role in TRAINABLE_ROLES
        rows = derived.samples_per_update.get(role, derived.samples_per_step) / shard.dp
        micro = max(1, math.ceil(rows * (prompt + response) / tokens))
        memories[role] = role_memory(
            dims,
            shard,
            dtype_bytes=_dtype_bytes(cfg, role_cfg.dtype),
            trainable=trainable,
            recompute=role_cfg.recompute,
            tokens=tokens,
            micro_batches=micro,
            chunk=role_cfg.logprob_chunk_tokens,
            sp=cfg.resources.accelerator == "gpu",
            value_head=role in VALUE_HEAD_ROLES,
        )
        lay = role_cfg.layout
        layouts[role] = (
            f"tp{lay.tp} pp{lay.pp}"
            + (f" vpp{lay.vpp}" if lay.vpp > 1 else "")
            + f" cp{lay.cp} ep{lay.ep} dp{shard.dp}"
            + (" recompute" if role_cfg.recompute else "")
            + (" offload" if role_cfg.offload else "")
        )
    layouts["rollout"] = f"tp{cfg.rollout.tp} x{derived.rollout_engines} engines ({cfg.rollout.mode})"
    return memories, layouts


def pool_phases(cfg: RunConfig, derived, roles: dict[str, RoleMemory], vllm: VLLMMemory) -> dict:
    """Pool -> phase -> bytes on one GPU (see the module docstring)."""
    ro = cfg.rollout
    colocated = ro.mode == "colocated"
    phases: dict[str, dict[str, int]] = {}
    for pool in derived.pool_gpus:
        members = [r for r in derived.roles if getattr(cfg, r).pool == pool]
        resident = {r: 0 if getattr(cfg, r).offload else roles[r].static for r in members}
        engine_here = ro.pool == pool
        asleep = VLLM_NON_TORCH_BYTES if engine_here else 0
        out = {}
        if engine_here:
            out["generate"] = vllm.budget + sum(resident.values()) + CONTEXT_BYTES
        for r in members:
            others = sum(v for k, v in resident.items() if k != r)
            verb = "update" if r in TRAINABLE_ROLES else "forward"
            out[f"{r} {verb}"] = roles[r].peak + others + asleep + CONTEXT_BYTES
        if "actor" in members or engine_here:
            out["weight sync"] = _sync_phase(cfg, roles, resident, vllm, pool, colocated)
        if out:
            phases[pool] = out
    return phases


def _sync_phase(cfg, roles, resident, vllm: VLLMMemory, pool: str, colocated: bool) -> int:
    tp = cfg.actor.layout.tp
    actor_here = cfg.actor.pool == pool
    engine_here = cfg.rollout.pool == pool
    bucket = cfg.rollout.sync_bucket_mb << 20
    total = CONTEXT_BYTES + sync_buffer_bytes(bucket, tp, receiver=engine_here, sender=actor_here)
    if actor_here:
        total += roles["actor"].static + sum(v for k, v in resident.items() if k != "actor")
    if engine_here:
        total += vllm.budget if not colocated else vllm.weights + VLLM_NON_TORCH_BYTES
    return total


# ----------------------------------------------------------------------------- time


def phase_times(
    cfg: RunConfig, dims: ModelDims, derived, roles, vllm: VLLMMemory, gpu: GPUSpec, a: Assumptions
) -> dict[str, float]:
    """Seconds per RL step of each phase (sequential, as RLTrainer.train_step runs them)."""
    _, prompt, response = _lengths(cfg, a)
    samples, n_active = derived.samples_per_step, active_params(dims)
    seq = prompt + response
    attention = 2 * dims.num_layers * dims.num_heads * dims.head_dim * samples * seq * seq
    forward = 2 * n_active * samples * seq + attention
    speed = gpu.bf16_flops * a.mfu
    times = {"generate": generation_time(cfg, dims, derived, vllm, gpu, a)}
    tokens = samples * seq
    for role in derived.roles:
        world, role_cfg = derived.role_world[role], getattr(cfg, role)
        activation_comm = _activation_comm_time(cfg, dims, role_cfg.layout, derived.role_dp[role], tokens, gpu)
        times[f"{role} forward"] = forward / (world * speed) + activation_comm
        if role in TRAINABLE_ROLES:
            lay = role_cfg.layout
            factor = 4 if role_cfg.recompute else 3
            bubble = 1 + (lay.pp - 1) / (lay.vpp * max(1, derived.updates_per_step[role]) * 4)
            dp_comm = derived.updates_per_step[role] * _dp_comm_time(
                cfg, roles[role], derived.role_dp[role], world, gpu
            )
            times[f"{role} update"] = (
                role_cfg.epochs_per_step * (factor * (forward * bubble / (world * speed) + activation_comm)) + dp_comm
            )
        if getattr(cfg, role).offload:
            calls = 2 if role in TRAINABLE_ROLES else 1
            times[f"{role} offload"] = calls * 2 * roles[role].static / a.host_bandwidth
    times["weight sync"] = sync_time(cfg, dims, gpu)
    return times


def _bandwidth(cfg: RunConfig, ranks: int, gpu: GPUSpec) -> float:
    """NVLink when a group of `ranks` consecutive GPUs stays inside a node, else the network."""
    return gpu.nvlink_bandwidth if ranks <= cfg.resources.gpus_per_node else gpu.network_bandwidth


def _activation_comm_time(cfg: RunConfig, dims: ModelDims, layout, dp: int, tokens: float, gpu: GPUSpec) -> float:
    """One forward's TP collectives (4 per layer: sequence-parallel all-gathers / reduce-scatters of the
    hidden states) and MoE token dispatch + combine (all-to-all over EP), on one GPU."""
    per_rank = tokens / (dp * layout.cp)
    layers = dims.num_layers / layout.pp
    h = dims.hidden_size
    tp = 4 * layers * per_rank * h * 2 * (layout.tp - 1) / layout.tp / _bandwidth(cfg, layout.tp, gpu)
    ep = 0.0
    if dims.moe and layout.ep > 1:
        ep_bytes = 2 * layers * per_rank / layout.tp * dims.moe.topk * h * 2 * (layout.ep - 1) / layout.ep
        ep = ep_bytes / _bandwidth(cfg, layout.tp * layout.ep, gpu)
    return tp + ep


def _dp_comm_time(cfg: RunConfig, memory: RoleMemory, dp: int, world: int, gpu: GPUSpec) -> float:
    """One optimizer step's gradient reduce-scatter (fp32) and parameter all-gather over DP."""
    if dp == 1:
        return 0.0
    params = memory.grads / 4
    return params * (4 + 2) * (dp - 1) / dp / _bandwidth(cfg, world, gpu)


def generation_time(cfg: RunConfig, dims: ModelDims, derived, vllm: VLLMMemory, gpu: GPUSpec, a: Assumptions) -> float:
    """Waves of concurrent sequences per engine; a decode step is max(FLOPs, HBM bytes) per GPU."""
    _, prompt, response = _lengths(cfg, a)
    tp = cfg.rollout.tp
    per_engine = math.ceil(derived.samples_per_step / derived.rollout_engines)
    capacity = max(0, vllm.kv_cache) // vllm.kv_bytes_per_token
    batch = max(1, min(per_engine, VLLM_MAX_SEQS, int(capacity // (prompt + response))))
    waves = math.ceil(per_engine / batch)
    n_active = active_params(dims)
    flops = 2 * n_active * batch / (tp * gpu.bf16_flops * 0.5)
    read = (vllm.weights + batch * (prompt + response / 2) * vllm.kv_bytes_per_token) / gpu.hbm_bandwidth
    prefill = 2 * n_active * per_engine * prompt / (tp * gpu.bf16_flops * a.mfu)
    return waves * cfg.rollout.max_response_tokens * max(flops, read) + prefill


def sync_time(cfg: RunConfig, dims: ModelDims, gpu: GPUSpec) -> float:
    """bf16 weights gathered to each rollout rank: NVLink inside a node, the network across nodes."""
    nbytes = total_params(dims) * 2
    per_node = cfg.resources.gpus_per_node
    inside = cfg.rollout.mode == "colocated" and cfg.actor.layout.model_parallel_size <= per_node
    if inside:
        return nbytes / cfg.rollout.tp / gpu.nvlink_bandwidth
    return nbytes / gpu.network_bandwidth


# ----------------------------------------------------------------------------- the plan


def plan_run(cfg: RunConfig, dims: ModelDims, gpu: GPUSpec, assumptions: Assumptions = Assumptions()) -> Plan:
    """Predicted memory and time of `cfg` on `gpu` (ConfigError when the sizes do not divide)."""
    derived = derive(cfg)
    roles, layouts = role_memories(cfg, dims, derived, assumptions)
    vllm = vllm_memory(
        dims, cfg.rollout.tp, gpu.hbm_bytes, cfg.rollout.gpu_memory_utilization, resolve_max_model_len(cfg)
    )
    plan = Plan(
        gpu=gpu,
        layouts=layouts,
        roles=roles,
        vllm=vllm,
        phases=pool_phases(cfg, derived, roles, vllm),
        times=phase_times(cfg, dims, derived, roles, vllm, gpu, assumptions),
        sequences_needed=math.ceil(derived.samples_per_step / derived.rollout_engines),
        role_dp=dict(derived.role_dp),
    )
    plan.warnings = _warnings(cfg, plan)
    return plan


def _warnings(cfg: RunConfig, plan: Plan) -> list[str]:
    out = []
    hbm = plan.gpu.hbm_bytes
    for pool, phases in plan.phases.items():
        for phase, nbytes in phases.items():
            if nbytes > hbm:
                out.append(
                    f"pool {pool!r}: {phase} needs {nbytes / 2**30:.1f} GiB per GPU > {plan.gpu.name}'s"
                    f" {hbm / 2**30:.1f} GiB (offload roles, raise tp/pp/ep, recompute, or lower"
                    " micro_batch_tokens / rollout.gpu_memory_utilization)"
                )
    if plan.vllm.kv_cache <= 0:
        out.append(
            f"rollout: vLLM's weights + overhead ({(plan.vllm.weights + plan.vllm.overhead) / 2**30:.1f} GiB)"
            f" exceed rollout.gpu_memory_utilization x HBM ({plan.vllm.budget / 2**30:.1f} GiB): no KV cache;"
            " raise rollout.tp or gpu_memory_utilization"
        )
    elif plan.vllm.sequences < 1:
        out.append(
            f"rollout: the KV cache ({plan.vllm.kv_cache / 2**30:.1f} GiB) holds no full-length sequence"
            f" of rollout.max_model_len={resolve_max_model_len(cfg)}; raise rollout.tp or gpu_memory_utilization"
        )
    return out
