"""Per-rank functions of the context-parallel tests (module level, so ranks can import them)."""
from __future__ import annotations

import functools

import torch

import engine_cases as C

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
    from megarl.engine.roles import LogProbHead, actor_loss

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

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, context_parallel_size=2,
                               use_cpu_initialization=True)
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
        scaled, _ = forward_step_calc_loss(model, model(tokens), loss_func, config, None, False, len(micro_batches),
                                           [], cp_group_size=groups.pg.cp.size(), is_last_stage=True)
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
