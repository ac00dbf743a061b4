"""megatron-core 0.19.2 on CPU/gloo through megatron_patches: GPTModel fwd/bwd at TP1 and TP2,
DDP + distributed optimizer at DP2 vs DP1, dist_checkpointing round trip, RNG tracker, version
check, device mode.

Two rank processes in all (one 1-rank run, one 2-rank run), each checking several things, so the
file stays well under 90 s on 2 cores. Worker functions are module-level so spawned ranks can
import them. The pytest process itself never applies the patches.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.testing.dist import run_distributed

SEED = 1234
SEQ, BATCH, VOCAB = 16, 4, 128


# ---------------------------------------------------------------- helpers run inside the ranks
def _build_gpt(tp: int, seed: int = SEED, pp: int = 1):
    """Tiny fp32 GPTModel (local spec) after (re)initialising model parallel with TP=tp, PP=pp."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model, config


def _build_llama_like(recompute: bool, seed: int = SEED):
    """RoPE + RMSNorm + SwiGLU, dropout 0.1, parameters created on the (CPU) "current device"
    (use_cpu_initialization=False: patch 2 and the tracker's model-parallel state), optional full
    activation recompute (CheckpointFunction saves/restores the RNG states: patch 1)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    recompute_args = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    )
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=torch.float32,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=False,
        **recompute_args,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def _recompute_dropout_checks() -> dict:
    """Same seed ⇒ same dropout masks, with and without activation recompute (grads identical)."""
    results = []
    for recompute, seed in ((False, SEED), (True, SEED), (False, SEED + 1)):
        model = _build_llama_like(recompute, seed)
        torch.manual_seed(seed + 100)  # same default-generator state before each forward
        loss = _loss(model)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b), (loss_c, _) = results
    return {
        "loss": loss_a,
        "recompute_same_loss": loss_a == loss_b,
        "recompute_same_grads": all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)),
        "other_seed_other_loss": loss_a != loss_c,
    }


def _batch(rows: slice = slice(None)):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal_mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked
    return tokens[rows], position_ids[rows], causal_mask, labels[rows]


def _loss(model, rows: slice = slice(None)) -> torch.Tensor:
    tokens, position_ids, mask, labels = _batch(rows)
    return model(tokens, position_ids, mask, labels=labels).mean()


def _forward_backward(model) -> tuple[float, bool]:
    loss = _loss(model)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    ok = len(grads) == len(list(model.parameters())) and all(torch.isfinite(g).all() for g in grads)
    return loss.item(), ok


def _ddp_distopt(model, config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, use_distributed_optimizer=True, bf16=False, fp16=False, clip_grad=1.0
    )
    return model, get_megatron_optimizer(opt_config, [model])


def _train_step(model, optimizer, rows: slice) -> tuple[float, float]:
    """One DDP + distributed-optimizer step on `rows`; returns (loss before, full-batch loss after)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _loss(model, rows)
    loss.backward()
    model.finish_grad_sync()
    success, grad_norm, _ = optimizer.step()
    assert success and math.isfinite(grad_norm), (success, grad_norm)
    with torch.no_grad():
        return loss.item(), _loss(model).item()


def _pipeline_losses(model, num_microbatches: int = 2) -> list[float]:
    """forward_backward_func (1F1B at PP2) over the batch split in micro-batches; last stage's losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, position_ids, mask, labels = _batch()
    mbs = BATCH // num_microbatches
    micro_batches = iter(
        [(tokens[i : i + mbs], position_ids[i : i + mbs], labels[i : i + mbs]) for i in range(0, BATCH, mbs)]
    )

    def forward_step(data_iterator, model):
        tok, pos, lab = next(data_iterator)
        per_token = model(tok, pos, mask, labels=lab)
        return per_token, lambda out: (out.mean(), {"loss": out.mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro_batches,
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=mbs,
        forward_only=False,
    )
    return [d["loss"].item() for d in losses]


def _patch_lifecycle_checks() -> dict:
    """apply is idempotent (one device mode on the stack); remove restores torch.cuda; re-apply works."""
    from megatron_patches import apply_cpu_patches, patches_applied, remove_cpu_patches
    from megatron_patches.device_mode import CpuDeviceMode

    def modes():
        return sum(isinstance(m, CpuDeviceMode) for m in torch.overrides._get_current_function_mode_stack())

    out = {"second_apply": apply_cpu_patches(), "modes_after_second_apply": modes()}
    remove_cpu_patches()
    out["removed"] = not patches_applied() and modes() == 0
    try:
        torch.cuda.current_device()
        out["current_device_restored"] = False
    except (AssertionError, RuntimeError):
        out["current_device_restored"] = True
    out["reapplied"] = apply_cpu_patches() and modes() == 1 and torch.cuda.current_device().type == "cpu"
    return out


def _rng_checks() -> dict:
    """Tracker fork: same seed → same dropout mask, outer state restored, no CPU-RNG warning."""
    import logging

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    x = torch.ones(1000)
    masks, after = [], []
    warnings_seen = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings_seen.append(record.getMessage())
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)
    for seed in (7, 7, 8):
        model_parallel_cuda_manual_seed(seed)
        with get_cuda_rng_tracker().fork():
            masks.append(torch.nn.functional.dropout(x, 0.5, training=True))
        after.append(torch.rand(4))  # drawn from the default (data-parallel) state
    model_parallel_cuda_manual_seed(7)
    no_fork = torch.rand(4)
    return {
        "same_seed_same_mask": torch.equal(masks[0], masks[1]),
        "other_seed_other_mask": not torch.equal(masks[0], masks[2]),
        "fork_restores_outer_state": torch.equal(after[0], no_fork),
        "warnings": warnings_seen,
    }


# ---------------------------------------------------------------- rank entry points
def single_rank_checks() -> dict:
    """World size 1: TP1 forward/backward, RNG tracker, DP1 reference step."""
    from megatron_patches import patches_applied

    out = {"patched": patches_applied(), "lifecycle": _patch_lifecycle_checks()}
    model, _ = _build_gpt(tp=1)
    out["tp1_loss"], out["tp1_grads_ok"] = _forward_backward(model)
    out["rng"] = _rng_checks()  # needs model parallel initialised
    out["recompute"] = _recompute_dropout_checks()
    model, config = _build_gpt(tp=1)
    model, optimizer = _ddp_distopt(model, config)
    out["dp1_before"], out["dp1_after"] = _train_step(model, optimizer, slice(None))
    return out


def two_rank_checks(ckpt_dir: str) -> dict:
    """World size 2: TP2 forward/backward + checkpoint save; TP1×DP2 load (reshard) + DistOpt step;
    PP2 load (layer offsets) + 1F1B schedule."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    out = {}
    model, _ = _build_gpt(tp=2)
    out["tp2_loss"], out["tp2_grads_ok"] = _forward_backward(model)
    model.zero_grad()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    model, config = _build_gpt(tp=1, seed=SEED + 1)  # different init, overwritten by the load
    out["loss_before_load"] = _loss(model).item()
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    with torch.no_grad():
        out["loss_after_load"] = _loss(model).item()

    model, optimizer = _ddp_distopt(model, config)
    half = BATCH // 2
    out["dp2_before"], out["dp2_after"] = _train_step(model, optimizer, slice(rank * half, (rank + 1) * half))

    model, _ = _build_gpt(tp=1, pp=2, seed=SEED + 1)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    out["pp2_losses"] = _pipeline_losses(model)
    return out


# ---------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(single_rank_checks, 1, timeout=120)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("mcore_ckpt"))
    return run_distributed(two_rank_checks, 2, ckpt_dir, timeout=180)


def test_gpt_forward_backward_tp1_and_tp2_give_same_loss(single_rank, two_ranks):
    assert single_rank["patched"]
    assert single_rank["tp1_grads_ok"] and all(r["tp2_grads_ok"] for r in two_ranks)
    assert two_ranks[0]["tp2_loss"] == two_ranks[1]["tp2_loss"]
    assert abs(single_rank["tp1_loss"] - two_ranks[0]["tp2_loss"]) < 1e-5
    assert abs(single_rank["tp1_loss"] - math.log(VOCAB)) < 0.5  # untrained: near uniform


def test_dist_checkpoint_tp2_save_loads_into_tp1_dp2(two_ranks, single_rank):
    for r in two_ranks:
        assert abs(r["loss_before_load"] - r["tp2_loss"]) > 1e-4  # the load has work to do
        assert abs(r["loss_after_load"] - single_rank["tp1_loss"]) < 1e-5


def test_distributed_optimizer_dp2_step_lowers_loss_and_matches_dp1(single_rank, two_ranks):
    assert single_rank["dp1_after"] < single_rank["dp1_before"] - 1e-3
    for r in two_ranks:
        assert abs(r["dp2_after"] - single_rank["dp1_after"]) < 1e-4
    assert two_ranks[0]["dp2_after"] == two_ranks[1]["dp2_after"]  # replicas stay in sync


def test_pp2_pipeline_schedule_reproduces_tp1_loss_from_checkpoint(single_rank, two_ranks):
    assert two_ranks[0]["pp2_losses"] == []  # only the last stage computes the loss
    micro_losses = two_ranks[1]["pp2_losses"]
    assert len(micro_losses) == 2
    assert abs(sum(micro_losses) / 2 - single_rank["tp1_loss"]) < 1e-5


def test_apply_is_idempotent_and_remove_restores_torch_cuda(single_rank):
    lifecycle = single_rank["lifecycle"]
    assert lifecycle["second_apply"] is True and lifecycle["modes_after_second_apply"] == 1
    assert lifecycle["removed"] and lifecycle["current_device_restored"]
    assert lifecycle["reapplied"]


def test_rng_tracker_fork_is_reproducible_with_same_seed(single_rank):
    rng = single_rank["rng"]
    assert rng["same_seed_same_mask"] and rng["other_seed_other_mask"]
    assert rng["fork_restores_outer_state"]
    assert not any("CPU RNG state changed" in m for m in rng["warnings"])


def test_activation_recompute_replays_dropout_rng_exactly(single_rank):
    recompute = single_rank["recompute"]
    assert math.isfinite(recompute["loss"])
    assert recompute["recompute_same_loss"] and recompute["recompute_same_grads"]
    assert recompute["other_seed_other_loss"]
