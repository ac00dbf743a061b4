"""Benchmark: megarl's GAE and PPO-clip policy loss against textbook references, same run.

    python benchmarks/algorithms.py                 # B=512, T=4096
    python benchmarks/algorithms.py --batch 64 --seq 1024
    python benchmarks/algorithms.py --quick         # small, seconds

References (what most codebases ship):
  * GAE: the per-timestep Python loop, vectorised only across B (verl's `compute_gae_advantage_return`
    with masked-token skipping), followed by masked whitening.
  * PPO loss: the unfused elementwise version (ratio, pg_losses1/2, max, dual-clip where, masked mean),
    forward + backward.
Prints time per call (best of --repeats, ref and ours alternating), `speedup = ref_time / ours`
and the max |difference| between the two.
Imports only torch (runs on CPU; uses CUDA when available unless --device cpu).
"""

import argparse
import os
import time

import torch

from megarl.algorithms.advantages import AdvantageConfig, AdvantageInputs, gae
from megarl.algorithms.aggregation import LossAggregation
from megarl.algorithms.policy_loss import PolicyLossConfig, PolicyLossInputs, ppo_clip


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE: reverse loop over T, masked tokens skipped, then masked whitening."""
    mask = mask.to(values.dtype)
    B, T = values.shape
    nextvalues = torch.zeros(B, dtype=values.dtype, device=values.device)
    lastgaelam = torch.zeros_like(nextvalues)
    advantages_reversed = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = (advantages + values) * mask
    mean = (advantages * mask).sum() / mask.sum()
    var = (((advantages - mean) ** 2) * mask).sum() / (mask.sum() - 1)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def reference_ppo_loss(log_prob, old_log_prob, advantages, mask, clip_low, clip_high, clip_c):
    """Unfused PPO dual-clip loss (verl's `compute_policy_loss` shape), token-mean."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = (pg_losses * mask).sum() / mask.sum()
    clipfrac = ((torch.gt(pg_losses2, pg_losses1).float() * mask).sum() / mask.sum()).detach()
    ppo_kl = ((-negative_approx_kl * mask).sum() / mask.sum()).detach()
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}


def make_inputs(batch, seq, device, seed=0):
    """Right-padded responses of random length, outcome reward on the last token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    rewards = torch.zeros(batch, seq)
    rewards[torch.arange(batch), lengths - 1] = torch.randn(batch, generator=gen)
    values = torch.randn(batch, seq, generator=gen)
    log_probs = -torch.rand(batch, seq, generator=gen) * 3
    old_log_probs = log_probs + 0.1 * torch.randn(batch, seq, generator=gen)
    tensors = dict(
        mask=mask,
        rewards=rewards,
        values=values,
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=torch.randn(batch, seq, generator=gen),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def compare(ref_fn, ours_fn, device, repeats):
    """Best wall time of each function over `repeats` alternating calls (after a warm-up of each),
    so both see the same machine load."""

    def timed(fn):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(ref_fn), timed(ours_fn)
    times = [(timed(ref_fn), timed(ours_fn)) for _ in range(repeats)]
    return min(r for r, _ in times), min(o for _, o in times)


def bench_gae(data, device, repeats, gamma, lam):
    cfg = AdvantageConfig(estimator="gae", gamma=gamma, lam=lam)
    inputs = AdvantageInputs(data["rewards"], data["mask"], values=data["values"])
    ours = lambda: gae(inputs, cfg)  # noqa: E731
    ref = lambda: reference_gae(data["rewards"], data["values"], data["mask"], gamma, lam)  # noqa: E731
    t_ref, t_ours = compare(ref, ours, device, repeats)
    return t_ref, t_ours, (ours()[0] - ref()[0]).abs().max().item()


def bench_ppo(data, device, repeats):
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    agg = LossAggregation("token-mean")

    def run(fn):
        log_probs = data["log_probs"].clone().requires_grad_(True)
        loss = fn(log_probs)
        loss.backward()
        return loss.detach(), log_probs.grad

    def ours(log_probs):
        inputs = PolicyLossInputs(log_probs, data["old_log_probs"], data["advantages"], data["mask"])
        return ppo_clip(inputs, cfg, agg)[0]

    def ref(log_probs):
        return reference_ppo_loss(
            log_probs, data["old_log_probs"], data["advantages"], data["mask"].float(), 0.2, 0.28, 3.0
        )[0]

    t_ref, t_ours = compare(lambda: run(ref), lambda: run(ours), device, repeats)
    (l1, g1), (l2, g2) = run(ours), run(ref)
    return t_ref, t_ours, max((l1 - l2).abs().item(), (g1 - g2).abs().max().item())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="B=64, T=512, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 64, 512, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = make_inputs(args.batch, args.seq, device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"B={args.batch} T={args.seq} device={device} threads={torch.get_num_threads()} "
        f"cpus={os.cpu_count()} load_avg_1min={load:.1f} (on a busy machine prefer --threads 1)"
    )
    print(f"{'case':34s} {'ref ms':>9s} {'ours ms':>9s} {'speedup':>8s} {'max|diff|':>10s}")
    rows = [
        (f"gae gamma={g} lam={lam}", *bench_gae(data, device, args.repeats, g, lam))
        for g, lam in ((1.0, 1.0), (1.0, 0.95), (0.99, 0.95))
    ]
    rows.append(("ppo_clip dual-clip fwd+bwd", *bench_ppo(data, device, args.repeats)))
    for name, ref, ours, diff in rows:
        print(f"{name:34s} {ref * 1e3:9.2f} {ours * 1e3:9.2f} {ref / ours:7.1f}x {diff:10.2e}")


if __name__ == "__main__":
    main()
