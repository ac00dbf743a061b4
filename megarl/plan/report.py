"""Text tables and JSON of a `Plan` and of a layout search (what `megarl plan` prints).

Owns: `format_plan`, `plan_json`, `format_search`, `search_json`, `memory_summary` (the lines
`megarl config --validate-only` adds). Pure formatting; imports megarl.plan only.
"""

from __future__ import annotations

from megarl.plan.planner import Plan

GiB = 2**30


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def format_plan(plan: Plan) -> str:
    """Per role memory breakdown, per pool phases against HBM, per phase time, then the verdict."""
    g = plan.gpu
    lines = [
        f"GPU {g.name}: {_gib(g.hbm_bytes)} GiB HBM, {g.bf16_flops / 1e12:.0f} TFLOP/s bf16,"
        f" {g.hbm_bandwidth / 1e12:.2f} TB/s HBM, {g.nvlink_bandwidth / 1e9:.0f} GB/s NVLink,"
        f" {g.network_bandwidth / 1e9:.0f} GB/s network",
        "",
        f"{'role':<13}{'layout':<46}{'weights':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'logits':>8}"
        f"{'peak':>8}  GiB/GPU",
    ]
    for role, m in plan.roles.items():
        lines.append(
            f"{role:<13}{plan.layouts[role]:<46}{_gib(m.weights):>8}{_gib(m.grads):>8}{_gib(m.optimizer):>8}"
            f"{_gib(m.activations):>8}{_gib(m.logits):>8}{_gib(m.peak):>8}"
        )
    v = plan.vllm
    lines += [
        f"{'rollout':<13}{plan.layouts['rollout']:<46}{_gib(v.weights):>8}  KV cache {_gib(v.kv_cache)} GiB of"
        f" {_gib(v.budget)} GiB budget (overhead {_gib(v.overhead)}): {v.sequences} full-length sequences"
        f" per engine ({plan.sequences_needed} sent per step)",
        "",
    ]
    for pool, phases in plan.phases.items():
        worst = max(phases, key=phases.get)
        cells = ", ".join(f"{name} {_gib(nbytes)}" for name, nbytes in phases.items())
        lines.append(f"pool {pool}: {cells} GiB; peak {_gib(phases[worst])} ({worst}) of {_gib(g.hbm_bytes)} GiB")
    lines.append(
        "time per step: " + ", ".join(f"{k} {v:.1f}s" for k, v in plan.times.items()) + f"; total {plan.step_time:.1f}s"
    )
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: margin {_gib(plan.margin)} GiB per GPU")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    """The plan as plain JSON types (bytes as integers, seconds as floats)."""
    return {
        "gpu": vars(plan.gpu),
        "layouts": plan.layouts,
        "roles": {r: {**vars(m), "static": m.static, "peak": m.peak} for r, m in plan.roles.items()},
        "role_dp": plan.role_dp,
        "vllm": vars(plan.vllm),
        "sequences_needed": plan.sequences_needed,
        "phases": plan.phases,
        "peak": plan.peak,
        "margin": plan.margin,
        "fits": plan.fits,
        "times": plan.times,
        "step_time": plan.step_time,
        "warnings": plan.warnings,
    }


def format_search(candidates, top: int) -> str:
    """The best `top` candidates: layout, fit, margin, step time and its largest phases."""
    lines = [f"{'#':>3}  {'layout':<46}{'fits':>5}{'margin GiB':>11}{'step s':>9}  slowest phases"]
    for i, c in enumerate(candidates[:top], 1):
        slow = sorted(c.plan.times.items(), key=lambda kv: -kv[1])[:2]
        lines.append(
            f"{i:>3}  {c.name:<46}{'yes' if c.plan.fits else 'no':>5}{_gib(c.plan.margin):>11}"
            f"{c.plan.step_time:>9.1f}  " + ", ".join(f"{k} {v:.1f}s" for k, v in slow)
        )
    fitting = sum(c.plan.fits for c in candidates)
    lines.append(f"{len(candidates)} valid layouts, {fitting} predicted to fit")
    return "\n".join(lines)


def search_json(candidates, top: int) -> list[dict]:
    return [
        {
            "layout": c.name,
            "tp": c.tp,
            "pp": c.pp,
            "ep": c.ep,
            "rollout_tp": c.rollout_tp,
            "recompute": c.recompute,
            **plan_json(c.plan),
        }
        for c in candidates[:top]
    ]


def memory_summary(plan: Plan) -> list[str]:
    """`# plan:` lines for `megarl config --validate-only`: peak per role, per pool, warnings."""
    roles = ", ".join(f"{r} {_gib(m.peak)} GiB" for r, m in plan.roles.items())
    pools = ", ".join(f"{pool} {_gib(peak)} GiB" for pool, peak in plan.peak.items())
    out = [
        f"# plan ({plan.gpu.name}, {_gib(plan.gpu.hbm_bytes)} GiB): predicted peak per GPU: {roles};"
        f" per pool (all phases): {pools}; vLLM KV cache {_gib(plan.vllm.kv_cache)} GiB"
        f" ({plan.vllm.sequences} full-length sequences per engine); margin {_gib(plan.margin)} GiB"
    ]
    return out + [f"# warning: {w}" for w in plan.warnings]
