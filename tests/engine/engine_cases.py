"""Shared inputs and per-rank functions of the engine tests (module level, so ranks can import them)."""

from __future__ import annotations

import contextlib
import threading

import torch

from megarl.data.batch import Batch

VOCAB = 96


def padded_batch(rows: int = 8, prompt: int = 6, response: int = 6, seed: int = 0) -> Batch:
    """Left-padded prompts + right-padded responses with RL columns (old log-probs, advantages, ...)."""
    gen = torch.Generator().manual_seed(seed)
    length = prompt + response
    ids = torch.randint(3, VOCAB, (rows, length), generator=gen)
    mask = torch.zeros(rows, length, dtype=torch.long)
    response_mask = torch.zeros(rows, response, dtype=torch.long)
    for r in range(rows):
        p = 1 + (r * 5) % prompt
        t = 1 + (r * 3) % response
        mask[r, prompt - p : prompt + t] = 1
        response_mask[r, :t] = 1
    ids = ids * mask
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response_mask,
        "old_log_probs": -3.0 + 0.1 * torch.randn(rows, response, generator=gen),
        "advantages": torch.randn(rows, response, generator=gen),
        "ref_log_probs": -3.0 + 0.1 * torch.randn(rows, response, generator=gen),
        "values": 0.1 * torch.randn(rows, response, generator=gen),
        "returns": torch.randn(rows, response, generator=gen),
    }
    return Batch(tensors)


def hf_log_probs(hf_path, batch: Batch) -> torch.Tensor:
    """transformers' log-probs of each response token on the unpadded rows, [B, T] (0 off the mask)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    response = batch["response_mask"].shape[1]
    length = batch["input_ids"].shape[1]
    out = torch.zeros(len(batch), response)
    with torch.no_grad():
        for r in range(len(batch)):
            cols = batch["attention_mask"][r].nonzero().squeeze(-1)
            ids = batch["input_ids"][r, cols].unsqueeze(0)
            logp = torch.log_softmax(model(ids).logits[0], -1)
            for t in range(response):
                pos = length - response + t
                if batch["response_mask"][r, t] and pos - 1 >= cols[0]:
                    i = pos - cols[0]
                    out[r, t] = logp[i - 1, ids[0, i]]
    return out


def build(
    hf_path, layout, *, first: bool = False, value_head: bool = False, optim=None, micro_batch_tokens=1000, **config
):
    """Role groups (collective) + engine at `layout`; `first` also initialises megatron's global state."""
    from megarl.engine.config import EngineConfig
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups, init_global_state

    groups = build_role_groups(layout)
    if first:
        init_global_state(groups)
    cfg = EngineConfig(layout=layout, micro_batch_tokens=micro_batch_tokens, optim=optim, **config)
    return MegatronEngine(hf_path, cfg, groups, value_head=value_head)


def linear_adam():
    """Adam whose first update is ≈ −grad (ε ≫ |g|, lr = ε): parameter deltas expose the gradient."""
    from megarl.engine.config import OptimConfig

    return OptimConfig(lr=1e4, adam_eps=1e4, clip_grad=1e9)


def local_rows(engine, batch):
    from megarl.engine.micro import shard_for_dp

    return shard_for_dp(batch, engine.groups.dp_size, engine.groups.dp_rank)


def full_actor_loss():
    """seq-mean-token-mean PPO + k3 KL loss + entropy bonus: every term of the actor objective."""
    from megarl.algorithms import KLConfig
    from megarl.workers import ActorLossConfig

    return ActorLossConfig(kl=KLConfig(coef=0.1), entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean")


def one_update(hf_path, layout, micro_batch_tokens, first, loss=None, critic=False, **config):
    """One actor (or critic) update at `layout`: (loss, grad norm, micro-batches, HF-named deltas on TP rank 0)."""
    from megarl.workers import Actor, ActorLossConfig, Critic

    engine = build(
        hf_path,
        layout,
        first=first,
        optim=linear_adam(),
        micro_batch_tokens=micro_batch_tokens,
        value_head=critic,
        **config,
    )
    before = {name: tensor.clone() for name, tensor in engine.hf_weights()}  # TP1 yields views
    role = Critic(engine) if critic else Actor(engine, loss or ActorLossConfig())
    metrics = role.update(local_rows(engine, padded_batch()))
    deltas = {name: after - before[name] for name, after in engine.hf_weights()}
    keep = engine.groups.tp_rank == 0 and engine.groups.dp_rank == 0
    return metrics["loss"], metrics["grad_norm"], metrics["micro_batches"], deltas if keep else {}


def updates_rank(scenarios):
    """Run each (hf_path, layout, micro_batch_tokens[, config]) scenario in turn in the same processes."""
    return [
        one_update(*scenario[:3], first=i == 0, **(scenario[3] if len(scenario) > 3 else {}))
        for i, scenario in enumerate(scenarios)
    ]


def adam(lr=1e-2):
    from megarl.engine.config import OptimConfig

    return OptimConfig(lr=lr, clip_grad=1.0)


def colocated_rank(actor_hf, critic_hf, steps, root):
    """Actor TP2 and critic TP1×DP2 in the same processes; a reference and a reward model beside them."""
    from megarl.engine.config import EngineConfig
    from megarl.engine.engine import MegatronEngine
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor, Critic, Reference, RewardModel

    actor = Actor(build(actor_hf, ParallelLayout(tp=2), first=True, optim=adam(), micro_batch_tokens=30))
    critic = Critic(build(critic_hf, ParallelLayout(tp=1), value_head=True, optim=adam(2e-3), micro_batch_tokens=30))
    reference = Reference(
        MegatronEngine(actor_hf, EngineConfig(layout=actor.engine.config.layout), actor.engine.groups)
    )
    reward = RewardModel(build(critic_hf, ParallelLayout(tp=2), value_head=True))
    batch = padded_batch()
    start = actor.compute_log_probs(batch)
    ref = reference.compute_log_probs(batch)["ref_log_probs"]
    scores = reward.compute_scores(batch)["rm_scores"]
    critic_rows = local_rows(critic.engine, batch)
    actor_losses = [actor.update(batch)["loss"] for _ in range(steps)]
    critic_losses = [critic.update(critic_rows)["loss"] for _ in range(steps)]
    critic.engine.save_checkpoint(f"{root}/critic")  # a TP1xDP2 role beside a TP2 one
    restored = Critic(build(critic_hf, ParallelLayout(tp=1), value_head=True, optim=adam(2e-3), micro_batch_tokens=30))
    restored.engine.load_checkpoint(f"{root}/critic")
    return {
        "start": start,
        "ref": ref,
        "scores": scores,
        "actor": actor_losses,
        "critic": critic_losses,
        "critic_values": critic.compute_values(critic_rows)["values"],
        "critic_rows": critic_rows["input_ids"],
        "restored_values": restored.compute_values(critic_rows)["values"],
    }


def offload_rank(hf, steps):
    """Two identical actors; one is offloaded and onloaded between steps. Returns both loss curves and weights."""
    from megarl.engine.offload import device_bytes
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    plain = Actor(build(hf, ParallelLayout(tp=2), first=True, optim=adam(), micro_batch_tokens=30))
    moved = Actor(build(hf, ParallelLayout(tp=2), optim=adam(), micro_batch_tokens=30))
    batch, curves, freed = padded_batch(), ([], []), []
    for _ in range(steps):
        curves[0].append(plain.update(batch)["loss"])
        curves[1].append(moved.update(batch)["loss"])
        moved.engine.offload()
        freed.append(device_bytes(moved.engine._state_tensors(), moved.engine.device.type))
        try:
            moved.update(batch)
            freed.append("trained while offloaded")
        except RuntimeError as err:
            assert "onload" in str(err)
        moved.engine.onload()
    weights = [{n: t.clone() for n, t in a.engine.hf_weights()} for a in (plain, moved)]
    return curves, freed, weights, subset_role_scores(hf)


def subset_role_scores(hf):
    """A reward model on rank 1 only (world of 2): groups are built everywhere, the engine only on its rank."""
    import torch.distributed as dist

    from megarl.engine.config import EngineConfig
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.parallel import build_role_groups
    from megarl.models.layout import ParallelLayout
    from megarl.workers import RewardModel

    groups = build_role_groups(ParallelLayout(), world_size=1, rank_offset=1)
    if not groups.is_member:
        return dist.get_rank(), None
    engine = MegatronEngine(hf, EngineConfig(layout=ParallelLayout()), groups, value_head=True)
    return dist.get_rank(), RewardModel(engine).compute_scores(padded_batch())["rm_scores"]


def scheduled_adam():
    from megarl.engine.config import OptimConfig

    return OptimConfig(
        lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6, decay_style="linear", clip_grad=1.0, weight_decay=0.01
    )


def _steps(actor, batch, n):
    return [(m["loss"], m["grad_norm"], m["lr"]) for m in (actor.update(batch) for _ in range(n))]


def checkpoint_rank(hf, root, save_at, total):
    """Train `total` steps saving at `save_at`; resume at the same layout and at PP2; a failed save leaves nothing."""
    from pathlib import Path

    from megarl.engine import checkpoint
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    batch, ckpt = padded_batch(), f"{root}/ckpt"
    actor = Actor(build(hf, ParallelLayout(tp=2), first=True, optim=scheduled_adam(), micro_batch_tokens=30))
    first = _steps(actor, batch, save_at)
    actor.engine.save_checkpoint(ckpt)
    saved = _weights(actor.engine)
    rest = _steps(actor, batch, total - save_at)
    final = {n: t.clone() for n, t in actor.engine.hf_weights()}
    actor.engine.export_hf(f"{root}/hf_export")
    final_logp = actor.compute_log_probs(batch)["old_log_probs"]

    resumed = Actor(build(hf, ParallelLayout(tp=2), optim=scheduled_adam(), micro_batch_tokens=30))
    meta = resumed.engine.load_checkpoint(ckpt)
    again = _steps(resumed, batch, total - save_at)
    same_weights = all(torch.equal(t, final[n]) for n, t in resumed.engine.hf_weights())

    other = Actor(build(hf, ParallelLayout(pp=2), optim=scheduled_adam(), micro_batch_tokens=30))
    other.engine.load_checkpoint(ckpt)
    other_steps = _steps(other, batch, 1)
    changed = Actor(build(hf, ParallelLayout(tp=2), optim=adam(5e-2), micro_batch_tokens=30))
    try:
        changed.engine.load_checkpoint(ckpt)
        changed_error = ""
    except Exception as err:  # noqa: BLE001 - the test checks the message
        changed_error = f"{type(err).__name__}: {err}"

    def broken_meta(*args):
        raise RuntimeError("simulated crash during save")

    checkpoint._meta, real_meta = broken_meta, checkpoint._meta
    try:
        actor.engine.save_checkpoint(ckpt)
        crashed = False
    except RuntimeError:
        crashed = True
    finally:
        checkpoint._meta = real_meta
    leftovers = sorted(p.name for p in Path(root).iterdir() if p.name.startswith("."))
    return {
        "first": first,
        "rest": rest,
        "again": again,
        "same_weights": same_weights,
        "meta": meta,
        "other": other_steps,
        "changed_error": changed_error,
        "crashed": crashed,
        "leftovers": leftovers,
        "step_after_load": resumed.engine.step - len(again),
        "final_logp": final_logp,
        "saved": saved,
    }


def _weights(engine) -> dict:
    return {n: t.clone() for n, t in engine.hf_weights()}


def decaying_adam():
    """No warm-up (the first step moves the weights), then a linear decay (each step its own LR)."""
    from megarl.engine.config import OptimConfig

    return OptimConfig(lr=1e-2, min_lr=1e-3, decay_steps=4, decay_style="linear", clip_grad=1.0, weight_decay=0.01)


def moe_checkpoint_rank(hf, root):
    """EP2 MoE actor: step, save, step; resume at EP2 and at EP1 (DP2 without EP) and take that step again.
    Then the other way: the EP1 engine saves, an EP2 engine loads that, and both take one more step."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    def actor(layout, first=False):
        return Actor(build(hf, layout, first=first, optim=decaying_adam(), micro_batch_tokens=30), full_actor_loss())

    batch, ckpt = padded_batch(), f"{root}/ckpt"
    ep2 = actor(ParallelLayout(ep=2), first=True)
    first = _steps(ep2, batch, 1)
    saved = _weights(ep2.engine)
    ep2.engine.save_checkpoint(ckpt)
    out = {"first": first, "saved": saved, "rest": _steps(ep2, batch, 1), "final": _weights(ep2.engine)}
    for name, layout in (("ep2", ParallelLayout(ep=2)), ("ep1", ParallelLayout())):
        resumed = actor(layout)
        resumed.engine.load_checkpoint(ckpt)
        loaded = _weights(resumed.engine)
        out[name] = {"loaded": loaded, "steps": _steps(resumed, batch, 1), "final": _weights(resumed.engine)}
    resumed.engine.save_checkpoint(f"{root}/ckpt_ep1")
    back = actor(ParallelLayout(ep=2))
    back.engine.load_checkpoint(f"{root}/ckpt_ep1")
    out["back"] = {"loaded": _weights(back.engine), "steps": _steps(back, batch, 1), "final": _weights(back.engine)}
    out["ep1"]["next"] = {"steps": _steps(resumed, batch, 1), "final": _weights(resumed.engine)}
    return out


def on_policy_rank(hf):
    """At DP2 with several micro-batches per rank: one actor update fed the old log-probs of a separate
    forward, and the same update taking them from its own forward (no old_log_probs column)."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    batch = padded_batch()
    results = {}
    for i, recomputed in enumerate((True, False)):
        engine = build(hf, ParallelLayout(), first=i == 0, optim=linear_adam(), micro_batch_tokens=14)
        actor, rows = Actor(engine), local_rows(engine, batch)
        old = actor.compute_log_probs(rows)["old_log_probs"]
        gen = torch.Generator().manual_seed(1 + engine.groups.dp_rank)
        rows["rollout_log_probs"] = old + 0.05 * torch.randn(old.shape, generator=gen) * rows["response_mask"]
        if recomputed:
            rows["old_log_probs"] = old
            results["gap_inputs"] = (old, rows["rollout_log_probs"], rows["response_mask"])
        else:
            rows = rows.select(*[k for k in rows.keys() if k != "old_log_probs"])
        before = {name: t.clone() for name, t in engine.hf_weights()}
        metrics = actor.update(rows)
        deltas = {name: after - before[name] for name, after in engine.hf_weights()}
        results["recomputed" if recomputed else "own"] = (metrics, deltas)
    return results


@contextlib.contextmanager
def held_checkpoint_writes():
    """Within the block every torch_dist file megarl writes waits (on its writing thread) until the block ends."""
    from megarl.models import dcp_save

    release, write = threading.Event(), dcp_save._write_file

    def held_write(*args):
        release.wait(120)
        return write(*args)

    dcp_save._write_file = held_write
    try:
        yield
    finally:
        release.set()
        dcp_save._write_file = write


def async_checkpoint_rank(hf, root):
    """An asynchronous save while training goes on: nothing is published before `finish_checkpoint`, and the
    checkpoint holds the state at the save (resumed, it trains as a synchronous save of that moment does);
    a write that fails on one rank fails the finish on every rank and leaves nothing behind."""
    from pathlib import Path

    from megarl.models import dcp_save
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    batch = padded_batch()
    actor = Actor(build(hf, ParallelLayout(tp=2), first=True, optim=scheduled_adam(), micro_batch_tokens=30))
    _steps(actor, batch, 2)
    actor.engine.save_checkpoint(f"{root}/sync")  # the same moment, saved synchronously
    with held_checkpoint_writes():
        actor.engine.save_checkpoint(f"{root}/async", wait=False)
        rest = _steps(actor, batch, 2)  # every weight and Adam moment changes while the save is pending
        published_early = Path(f"{root}/async").exists()
        finished_while_held = actor.engine.finish_checkpoint(wait=False)
    finished = actor.engine.finish_checkpoint(wait=True)
    resumed = {}
    for name in ("sync", "async"):
        again = Actor(build(hf, ParallelLayout(tp=2), optim=scheduled_adam(), micro_batch_tokens=30))
        again.engine.load_checkpoint(f"{root}/{name}")
        resumed[name] = _steps(again, batch, 2)

    def failing_write(transform_list, index, bucket):
        if torch.distributed.get_rank() == 1:
            raise OSError("simulated disk error")
        return write(transform_list, index, bucket)

    write = dcp_save._write_file
    dcp_save._write_file = failing_write
    try:
        actor.engine.save_checkpoint(f"{root}/failed", wait=False)
        try:
            actor.engine.finish_checkpoint(wait=True)
            failure = ""
        except Exception as err:  # noqa: BLE001 - the test checks it
            failure = f"{type(err).__name__}: {err}"
    finally:
        dcp_save._write_file = write
    actor.engine.save_checkpoint(f"{root}/after", wait=False)  # the engine saves again after a failed one
    actor.engine.finish_checkpoint(wait=True)
    leftovers = sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".") or p.name == "failed")
    return {
        "rest": rest,
        "resumed": resumed,
        "published_early": published_early,
        "finished_while_held": finished_while_held,
        "finished": finished,
        "failure": failure,
        "leftovers": leftovers,
        "after": Path(f"{root}/after/megarl_checkpoint.json").is_file(),
    }


def dp_sharded_checkpoint_rank(hf, root):
    """`reshardable=False` (each rank's optimizer shard as it holds it: live tensors, so the asynchronous
    save must copy them), DP2, its files held back while training takes two more steps: a resume at DP2
    continues bit for bit; TP2 is refused before anything is loaded."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    batch, ckpt = padded_batch(), f"{root}/dp_sharded"
    actor = Actor(build(hf, ParallelLayout(), first=True, optim=scheduled_adam(), micro_batch_tokens=30))
    _steps(actor, batch, 2)
    with held_checkpoint_writes():
        meta = actor.engine.save_checkpoint(ckpt, wait=False, reshardable=False)
        rest = _steps(actor, batch, 2)  # every Adam moment and main parameter changes in place meanwhile
    actor.engine.finish_checkpoint()
    resumed = Actor(build(hf, ParallelLayout(), optim=scheduled_adam(), micro_batch_tokens=30))
    resumed.engine.load_checkpoint(ckpt)
    again = _steps(resumed, batch, 2)
    other = Actor(build(hf, ParallelLayout(tp=2), optim=scheduled_adam(), micro_batch_tokens=30))
    before = _weights(other.engine)
    try:
        other.engine.load_checkpoint(ckpt)
        refused = ""
    except Exception as err:  # noqa: BLE001 - the test checks the message
        refused = f"{type(err).__name__}: {err}"
    untouched = all(torch.equal(t, before[n]) for n, t in other.engine.hf_weights())
    return {
        "format": meta["optimizer_format"],
        "rest": rest,
        "again": again,
        "refused": refused,
        "untouched": untouched,
    }


def dp_sharded_resume_rank(hf, root):
    """The DP2 checkpoint of `dp_sharded_checkpoint_rank` resumed on one rank (DP1): two steps."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    actor = Actor(build(hf, ParallelLayout(), optim=scheduled_adam(), micro_batch_tokens=30))
    actor.engine.load_checkpoint(f"{root}/dp_sharded")
    return _steps(actor, padded_batch(), 2)
