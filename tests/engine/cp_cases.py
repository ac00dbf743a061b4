"""Per-rank functions of the context-parallel tests (module level, so ranks can import them)."""

from __future__ import annotations

import functools

import engine_cases as C
import torch

HIDDEN = 16


def ragged_batch():
    """Rows of 2..18 real tokens (some shorter than 2·cp columns: whole CP chunks of padding)."""
    return C.padded_batch(rows=9, prompt=11, response=8, seed=5)


def cp_micro_batches(batch, cp: int, max_tokens: int = 1000):
    """The engine's micro-batches of `batch` at CP size `cp` (widths padded to a multiple of 2·cp)."""
    from megarl.engine.micro import make_micro_batches

    return make_micro_batches(batch, max_tokens, width_multiple=2 * cp if cp > 1 else 1)


def gather_round_trip_rank(cp: int):
    """Every rank splits the same ragged micro-batches, gathers them back over the world (= CP group)."""
    import torch.distributed as dist

    from megarl.engine.context import CPShard

    shard = CPShard(dist.group.WORLD, cp, dist.get_rank())
    out = []
    for mb in cp_micro_batches(ragged_batch(), cp, max_tokens=20):
        mb.cp = shard
        tokens, positions = mb.model_inputs()
        out.append((mb.tokens, mb.gather_cp(tokens.double()), mb.gather_cp(positions.double()), tokens.shape[1]))
    return out


def _token_model(vocab: int):
    """A per-token stand-in for the transformer (embedding → logits): no attention, so CP needs no exchange."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, vocab))


def _loss_parts(loss_config):
    from megarl.engine.heads import LogProbHead
    from megarl.workers.actor import actor_loss

    return LogProbHead(tp_group=None, vocab_size=C.VOCAB, chunk_tokens=7), actor_loss(loss_config)


def _cp1_reference(batch, loss_config):
    """Loss, per-parameter gradient and response log-probs of one update without CP (one process)."""
    from types import SimpleNamespace

    from megarl.engine.engine import with_global_denominators

    model, (head, loss_fn) = _token_model(C.VOCAB), _loss_parts(loss_config)
    batch = with_global_denominators(batch, SimpleNamespace(dp_size=1))
    total, log_probs = 0.0, torch.zeros(batch["response_mask"].shape)
    for mb in cp_micro_batches(batch, 1, max_tokens=20):
        outputs = head(model(mb.tokens), mb)
        loss, _ = loss_fn(outputs, mb)
        loss.backward()
        total += float(loss)
        log_probs[torch.as_tensor(mb.rows)] = outputs["log_probs"].detach()
    return total, [p.grad.clone() for p in model.parameters()], log_probs


def _ddp(model, groups):
    """megatron-core DDP over the role's dp_cp group (the engine's gradient reduction, unchanged)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, context_parallel_size=2, use_cpu_initialization=True
    )
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return config, DistributedDataParallel(config, ddp_config, model, pg_collection=groups.pg)


def _cp2_update(batch, loss_config, groups):
    """One update at CP=2 through the engine's pieces: split, head gather, `_micro_loss` scaling,
    megatron's `forward_step_calc_loss` (× cp / micro-batches) and DDP's dp_cp gradient reduction."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    from megarl.engine.context import CPShard
    from megarl.engine.engine import _micro_loss, with_global_denominators

    head, loss_fn = _loss_parts(loss_config)
    config, model = _ddp(_token_model(C.VOCAB), groups)
    model.zero_grad_buffer()
    batch = with_global_denominators(batch, groups)
    micro_batches = cp_micro_batches(batch, 2, max_tokens=20)
    store, log_probs = [], torch.zeros(batch["response_mask"].shape)
    for mb in micro_batches:
        mb.cp = CPShard(groups.pg.cp, 2, groups.cp_rank)
        tokens, _ = mb.model_inputs()
        loss_func = functools.partial(_micro_loss, head, loss_fn, mb, groups.dp_size * len(micro_batches), store)
        scaled, _ = forward_step_calc_loss(
            model,
            model(tokens),
            loss_func,
            config,
            None,
            False,
            len(micro_batches),
            [],
            cp_group_size=groups.pg.cp.size(),
            is_last_stage=True,
        )
        scaled.backward()
        with torch.no_grad():
            log_probs[torch.as_tensor(mb.rows)] = head(model(tokens), mb)["log_probs"]
    model.finish_grad_sync()
    loss = sum(float(entry[0]) for entry in store)
    return loss, [p.main_grad.clone() for p in model.module.parameters()], log_probs


def simulated_cp2_rank(loss_config):
    """CP=2 over the 2 ranks (DP=1) vs the cp=1 update computed on each rank alone."""
    from megarl.engine.parallel import build_role_groups, init_global_state
    from megarl.models.layout import ParallelLayout

    groups = build_role_groups(ParallelLayout(cp=2))
    init_global_state(groups)
    batch = ragged_batch()
    return _cp1_reference(batch, loss_config), _cp2_update(batch, loss_config, groups), groups.cp_rank


# ----------------------------------------------------------------------------- a CPU stand-in for TE's CP attention


class _GatherSeqFromCP(torch.autograd.Function):
    """[s/cp, b, ...] K or V of every CP rank → the full [S, b, ...] in sequence order.

    Unlike the heads' gather, each rank's attention (its own queries) uses the gathered K/V
    differently, so the backward sums the gradient over CP ranks before keeping this rank's rows.
    """

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as dist

        from megarl.engine.context import unpermute_from_cp

        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        return unpermute_from_cp(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        from megarl.engine.context import split_for_cp

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return split_for_cp(grad, ctx.group.size(), ctx.group.rank(), dim=0), None


class GatherKVAttention(torch.nn.Module):
    """Test-only core attention for cp > 1 in pure torch (TE's "all_gather" CP scheme, unfused):
    K and V are all-gathered over the CP group; this rank's queries sit at the zigzag positions
    `cp_columns(S, cp, rank)` and attend causally to every key at or before them."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        tp = pg_collection.tp.size()
        self.cp_group, self.heads = pg_collection.cp, config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        self.scale = softmax_scale or config.kv_channels**-0.5

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        from megarl.engine.context import cp_columns

        key, value = (_GatherSeqFromCP.apply(x, self.cp_group) for x in (key, value))
        key, value = (x.repeat_interleave(self.heads // self.kv_heads, dim=2) for x in (key, value))
        q_pos = cp_columns(key.shape[0], self.cp_group.size(), self.cp_group.rank())
        hidden = torch.arange(key.shape[0]).unsqueeze(0) > q_pos.unsqueeze(1)  # [s/cp, S]: future keys
        scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * self.scale
        probs = scores.masked_fill(hidden.to(scores.device), float("-inf")).softmax(-1).to(query.dtype)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value)
        return context.reshape(*context.shape[:2], -1)


def install_cpu_cp_attention():
    """Let the engine run cp > 1 on CPU: the local spec with `GatherKVAttention`, the TE check off."""
    import copy

    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megarl.engine import engine
    from megarl.models import spec

    def cp_layer_spec(dims):
        layer = copy.deepcopy(specs.get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm"))
        layer.submodules.self_attention.submodules.core_attention = GatherKVAttention
        return layer

    spec.layer_spec = cp_layer_spec
    engine.check_context_parallel = lambda layout: None


def cp_engine_rank(scenarios, hf_path, root):
    """With the CPU CP attention: `engine_cases.updates_rank`, cp=2 log-probs, a cp=2 → cp=1 checkpoint."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    install_cpu_cp_attention()
    updates = C.updates_rank(scenarios)
    actor = Actor(C.build(hf_path, ParallelLayout(cp=2), micro_batch_tokens=30))
    return updates, actor.compute_log_probs(C.padded_batch())["old_log_probs"], cp_checkpoint(hf_path, root)


def cp_checkpoint(hf_path, root):
    """Train a step at CP=2 and save; resume at CP=1 (DP=2) and at CP=2: (weights loaded equal the saved
    ones, and after one more step each: losses, grad norms, max weight difference (optimizer state))."""
    from megarl.models.layout import ParallelLayout
    from megarl.workers import Actor

    batch = C.padded_batch()
    actor = Actor(C.build(hf_path, ParallelLayout(cp=2), optim=C.adam(), micro_batch_tokens=30))
    actor.update(batch)
    actor.engine.save_checkpoint(f"{root}/cp2")
    saved = {n: t.clone() for n, t in actor.engine.hf_weights()}
    cp2 = actor.update(batch)
    other = Actor(C.build(hf_path, ParallelLayout(), optim=C.adam(), micro_batch_tokens=30))
    other.engine.load_checkpoint(f"{root}/cp2")
    loaded = all(torch.equal(t, saved[n]) for n, t in other.engine.hf_weights())
    cp1 = other.update(C.local_rows(other.engine, batch))
    after = dict(actor.engine.hf_weights())
    diff = max(float((t - after[n]).abs().max()) for n, t in other.engine.hf_weights())
    return loaded, (cp2["loss"], cp1["loss"]), (cp2["grad_norm"], cp1["grad_norm"]), diff


def gpu_batch():
    """Longer ragged rows for the GPU test (TE's CP kernels get a few tokens per chunk at least)."""
    return C.padded_batch(rows=8, prompt=48, response=40, seed=1)


def gpu_update_rank(hf_path, layout, micro_batch_tokens, loss=None):
    """bf16 (TE's CP attention has no fp32 kernel): log-probs, then one linear-Adam actor update; all on CPU."""
    from megarl.engine.config import OptimConfig
    from megarl.workers import Actor, ActorLossConfig

    # Linear Adam (engine_cases.linear_adam) with lr = 100·ε: each weight moves by ≈ −100·g, far above the
    # bf16 rounding of the weight itself, so bf16 deltas still resolve every gradient.
    engine = C.build(
        hf_path,
        layout,
        first=True,
        optim=OptimConfig(lr=1e6, adam_eps=1e4, clip_grad=1e9),
        micro_batch_tokens=micro_batch_tokens,
        dtype="bfloat16",
    )
    actor, batch = Actor(engine, loss or ActorLossConfig()), gpu_batch()
    log_probs = actor.compute_log_probs(batch)["old_log_probs"].float().cpu()
    before = {name: tensor.float().cpu() for name, tensor in engine.hf_weights()}
    metrics = actor.update(batch)
    deltas = {name: tensor.float().cpu() - before[name] for name, tensor in engine.hf_weights()}
    return metrics["loss"], metrics["grad_norm"], metrics["micro_batches"], deltas, log_probs
