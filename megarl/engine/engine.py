"""The Megatron training engine of one role: model chunks, DDP, distributed optimizer, schedules.

Owns: `MegatronEngine`. It builds the role's GPTModel chunks with the bridge on the role's own
process groups (`parallel.RoleGroups`), wraps them in megatron-core DDP with the distributed
optimizer and an LR scheduler, and runs megatron's `forward_backward_func` (no pipelining, 1F1B or
interleaved) over micro-batches packed by a token budget. It knows no algorithm: callers hand it

    head(model_output [b, S, ...], micro_batch) -> {name: tensor [b, T]}   (per-token outputs)
    loss_fn(outputs, micro_batch) -> (loss, stats)                        (training only)

where `loss` is normalised by the step's *global* denominators (`micro_batch.batch.meta`
carries `global_tokens` / `global_seqs` of `response_mask` over all DP ranks), so the gradient is
the same for any DP size, PP size, CP size or micro-batch split: the engine scales each micro-batch
loss by DP size × micro-batches to undo megatron's averaging (derived in `_micro_loss`).

Context parallelism (cp > 1, Transformer Engine only): each micro-batch is padded to a multiple of
2·cp columns and every CP rank feeds the model its load-balanced share (`context.py`); heads gather
per-token outputs back to full rows over the CP group, so outputs and losses equal cp=1.

Batches are this DP rank's rows (`micro.shard_for_dp` splits a full batch). Must not import vLLM
or Ray; roles (`megarl.workers`) compose an engine with heads and losses.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megarl.data.batch import Batch
from megarl.engine.config import EngineConfig
from megarl.engine.context import CPShard
from megarl.engine.micro import MicroBatch, make_micro_batches
from megarl.engine.parallel import RoleGroups, check_layout
from megarl.models.bridge import ModelBridge
from megarl.models.layout import LayoutError

Head = Callable[[torch.Tensor, MicroBatch], dict]
LossFn = Callable[[dict, MicroBatch], tuple]


def resolve_dtype(name: str, on_gpu: Optional[bool] = None) -> torch.dtype:
    """'auto' is bfloat16 on a GPU and float32 on CPU; `on_gpu` None: whether this process has CUDA (pass
    the run's accelerator where the caller may not run where the model does, e.g. a server-mode driver)."""
    if name == "auto":
        return torch.bfloat16 if (torch.cuda.is_available() if on_gpu is None else on_gpu) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class MegatronEngine:
    """One role's Megatron model on its own process groups: forward, train steps, offload, checkpoints."""

    def __init__(
        self, hf_path, config: EngineConfig, groups: RoleGroups, *, value_head: bool = False, load_weights: bool = True
    ):
        self.config, self.groups, self.hf_path = config, groups, str(hf_path)
        _check_groups(config, groups)
        validate_engine_config(hf_path, config, groups.world_size)
        self.bridge = ModelBridge.from_hf_path(
            hf_path, config.layout, dtype=resolve_dtype(config.dtype), value_head=value_head
        )
        self.tf_config = self._transformer_config()
        chunks = self.bridge.build(groups.pp_rank, config=self.tf_config, pg_collection=groups.pg)
        if value_head:
            _seed_value_head(chunks, config.seed)
        if load_weights:
            self.bridge.load_hf_weights(
                chunks, hf_path, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, ep_rank=groups.ep_rank
            )
        self.optimizer = self.scheduler = None
        self.model = self._wrap_for_training(chunks) if config.optim else chunks
        self.step = 0
        self.pending_checkpoint = None  # an asynchronous checkpoint still being written (engine.checkpoint)
        self._offloaded = None

    # ------------------------------------------------------------------ construction

    def _transformer_config(self):
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        # Variable micro-batch shapes are exchanged between stages, except under the interleaved
        # schedule: with PP=2 both neighbours are one peer and megatron's shape and tensor messages
        # cross (hangs on gloo), so VPP pads every micro-batch to one fixed shape instead.
        return self.bridge.transformer_config(
            variable_seq_lengths=self.config.layout.vpp == 1, **(recompute if self.config.recompute else {})
        )

    def _wrap_for_training(self, chunks):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        model = [
            DistributedDataParallel(
                self.tf_config, ddp_config, chunk, pg_collection=self.groups.pg, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(chunks)
        ]
        for chunk in model:
            chunk.broadcast_params()  # DP replicas start identical (e.g. a freshly initialised value head)
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        self.optimizer = self._optimizer(model)
        self.scheduler = self._scheduler(self.optimizer)
        return model

    def _optimizer(self, model):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.config.optim
        dtype = self.bridge.dtype
        cfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        )
        return get_megatron_optimizer(cfg, model, use_gloo_process_groups=False, pg_collection=self.groups.pg)

    def _scheduler(self, optimizer):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.config.optim
        decay_steps = max(o.decay_steps or 0, o.warmup_steps + 1)
        return OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=o.decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ properties

    @property
    def chunks(self) -> list:
        """The bare GPTModel chunks (DDP unwrapped)."""
        return [getattr(m, "module", m) for m in self.model]

    @property
    def tp_group(self):
        return self.groups.pg.tp

    @property
    def vocab_size(self) -> int:
        """Real (unpadded) vocabulary size."""
        return self.bridge.dims.vocab_size

    @property
    def device(self) -> torch.device:
        return _comm_device()

    # ------------------------------------------------------------------ forward / train

    def _micro_batches(self, batch: Batch) -> list[MicroBatch]:
        if self._offloaded is not None:
            raise RuntimeError("the engine's weights are offloaded; call engine.onload() before using it")
        layout = self.config.layout
        minimum = layout.pp if layout.vpp > 1 else 1
        # Sequence parallelism splits each CP rank's S/cp columns over TP; CP cuts S into 2*cp chunks.
        multiple = (layout.tp if self.tf_config.sequence_parallel else 1) * (2 * layout.cp if layout.cp > 1 else 1)
        micro_batches = make_micro_batches(
            batch,
            self.config.micro_batch_tokens,
            min_micro_batches=minimum,
            fixed_shape=layout.vpp > 1,
            width_multiple=multiple,
        )
        if layout.cp > 1:
            shard = CPShard(self.groups.pg.cp, layout.cp, self.groups.cp_rank)
            for mb in micro_batches:
                mb.cp = shard
        return micro_batches

    def _run(self, micro_batches: list[MicroBatch], step_fn, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        layout = self.config.layout
        fbf = get_forward_backward_func(pp_size=layout.pp, vp_size=layout.vpp if layout.vpp > 1 else None)
        extra = {"p2p_communicator": P2PCommunicator(self.groups.pg.pp, self.tf_config)} if layout.pp > 1 else {}
        return fbf(
            forward_step_func=step_fn,
            data_iterator=[iter(micro_batches) for _ in self.model],
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),  # full width; megatron divides by cp
            micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
            forward_only=forward_only,
            pg_collection=self.groups.pg,
            **extra,
        )

    def _step_fn(self, head: Head, loss_fn: Optional[LossFn], scale: float, store: list):
        device = self.device

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens, positions = mb.model_inputs()  # this CP rank's columns (all at cp=1)
            mask = _causal_mask(mb.tokens.shape[1], device) if mb.cp is None else None  # CP attention masks itself
            output = model(tokens.to(device), positions.to(device), mask)
            return output, functools.partial(_micro_loss, head, loss_fn, mb, scale, store)

        return forward_step

    def forward(self, batch: Batch, head: Head) -> dict:
        """Per-token outputs {name: [B, T]} of this rank's rows (in batch order), on every rank of the role."""
        micro_batches = self._micro_batches(batch)
        store: list = []
        for m in self.model:
            m.eval()
        with torch.no_grad():
            self._run(micro_batches, self._step_fn(head, None, 1.0, store), forward_only=True)
        outputs = _assemble(store, len(batch)) if self.groups.is_last_stage else None
        return _broadcast_from_last_stage(outputs, self.groups)

    def train_step(self, batch: Batch, head: Head, loss_fn: LossFn) -> dict:
        """One optimizer step on this rank's rows; returns metrics (loss, grad_norm, lr, stats)."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (config.optim is None)")
        batch = with_global_denominators(batch, self.groups)
        micro_batches = self._micro_batches(batch)
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        store: list = []
        self._run(
            micro_batches,
            self._step_fn(head, loss_fn, self.groups.dp_size * len(micro_batches), store),
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.step += 1
        return self._metrics(store, grad_norm, ok, micro_batches)

    def _metrics(self, store, grad_norm, ok, micro_batches) -> dict:
        local = _reduce_stats(store) if self.groups.is_last_stage else None
        if self.groups.is_last_stage:
            local = _all_reduce_stats(local, self.groups.pg.dp)
        stats = _broadcast_from_last_stage(local, self.groups)
        lr = self.optimizer.param_groups[0]["lr"]
        tokens = sum(mb.num_tokens for mb in micro_batches)
        return {
            **stats,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "update_ok": bool(ok),
            "micro_batches": len(micro_batches),
            "tokens": tokens,
        }

    # ------------------------------------------------------------------ weights

    def hf_weights(self):
        """HF-named full tensors of this pipeline stage (TP shards and, for MoE, every EP rank's experts gathered)."""
        return self.bridge.iter_hf_weights(
            self.chunks, pp_rank=self.groups.pp_rank, tp_group=self.groups.pg.tp, ep_group=self.groups.pg.ep
        )

    def save_checkpoint(self, path, *, overwrite: bool = True, wait: bool = True, reshardable: bool = True) -> dict:
        """Model, optimizer, scheduler, RNG and step, atomically (collective over the world); `wait=False`:
        the files are written on a thread and `finish_checkpoint` publishes them; `reshardable=False`: the
        optimizer state as each DP rank holds it (fast; loads at the same TP/PP/VPP/CP/EP only)."""
        from megarl.engine.checkpoint import save_checkpoint

        return save_checkpoint(self, path, overwrite=overwrite, wait=wait, reshardable=reshardable)

    def finish_checkpoint(self, *, wait: bool = True) -> bool:
        """Publish a checkpoint still being written (collective); False while some rank writes and not `wait`."""
        from megarl.engine.checkpoint import finish_checkpoint

        return finish_checkpoint(self, wait=wait)

    def load_checkpoint(self, path) -> dict:
        """Resume from `save_checkpoint`'s directory, at this engine's layout (any TP/PP/DP/EP; one saved with
        `reshardable=False`: the same TP/PP/VPP/CP/EP, any DP)."""
        from megarl.engine.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def export_hf(self, path, *, overwrite: bool = True) -> dict:
        """The model as an HF safetensors checkpoint (config and tokenizer files copied)."""
        from megarl.engine.checkpoint import export_hf

        return export_hf(self, path, overwrite=overwrite)

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the device (storage freed, views kept)."""
        from megarl.engine.offload import offload

        if self._offloaded is None:
            self._offloaded = offload(self._state_tensors())

    def onload(self) -> None:
        """Bring back everything `offload` moved, bit for bit."""
        from megarl.engine.offload import onload

        if self._offloaded is not None:
            onload(self._offloaded)
            self._offloaded = None

    def _state_tensors(self):
        from megarl.engine.offload import model_and_optimizer_tensors

        return model_and_optimizer_tensors(self.model, self.optimizer)


def validate_engine_config(hf_path, config: EngineConfig, world_size: int) -> ModelBridge:
    """Every check that needs no process group or weight: run it before launching a role.

    Raises LayoutError when the layout does not divide the world or the model's heads / layers / experts,
    or asks for context parallelism without Transformer Engine; NotImplementedError for MoE training at
    TP > 1 without TE; and the bridge's errors for bad HF configs.
    """
    check_layout(config.layout, world_size)
    check_context_parallel(config.layout)
    bridge = ModelBridge.from_hf_path(hf_path, config.layout, dtype=resolve_dtype(config.dtype))
    _check_moe_training(bridge, config)
    return bridge


def _check_moe_training(bridge: ModelBridge, config: EngineConfig) -> None:
    """megatron-core refuses to train MoE layers at TP > 1 without sequence parallelism, which needs TE (GPU)."""
    from megarl.models.spec import te_available

    if bridge.dims.moe and config.optim and config.layout.tp > 1 and not te_available():
        raise NotImplementedError(
            f"layout.tp={config.layout.tp} with a MoE model ({bridge.dims.model_type}): megatron-core trains MoE"
            " layers at TP > 1 only with sequence parallelism, which needs Transformer Engine (GPU); on CPU"
            " use tp=1 and split the experts with layout.ep instead"
        )


def check_context_parallel(layout) -> None:
    """cp > 1 needs Transformer Engine's attention: megatron-core's local (pure torch) attention
    asserts cp == 1, so without TE (any CPU machine) fail here, naming the fix, not deep in megatron."""
    from megarl.models.spec import te_available

    if layout.cp > 1 and not te_available():
        raise LayoutError(
            f"layout.cp={layout.cp}: context parallelism needs Transformer Engine's attention (a CUDA GPU with"
            " transformer_engine installed, e.g. the NGC PyTorch image); TE is not importable here, and"
            " megatron-core's local attention supports only cp=1. Install TE on a GPU machine or set layout.cp=1"
        )


def _seed_value_head(chunks, seed: int) -> None:
    """Initialise a scalar head from `seed` alone, so a critic started from a causal-LM checkpoint (no
    `score.weight`; the bridge keeps the head's init) starts the same at every layout and rank."""
    from megarl.models.spec import ValueHead as ScalarHead

    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if isinstance(head, ScalarHead):
            gen = torch.Generator().manual_seed(seed)
            init = torch.randn(head.weight.shape, generator=gen) * chunk.config.init_method_std
            with torch.no_grad():
                head.weight.copy_(init)


def _check_groups(config: EngineConfig, groups: RoleGroups) -> None:
    if not groups.is_member:
        raise ValueError("this rank is not part of the role's ranks; build engines only on member ranks")
    if config.layout != groups.layout:
        raise ValueError(f"engine layout {config.layout} differs from its process groups' {groups.layout}")


def with_global_denominators(batch: Batch, groups: RoleGroups) -> Batch:
    """Put the step's global loss-token and sequence counts (all DP ranks) into `batch.meta`."""
    from megarl.algorithms import loss_denominators

    out = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta), rows=len(batch))
    if "response_mask" not in batch:
        return out
    counts = torch.stack(loss_denominators(batch["response_mask"])).double().to(_comm_device())
    if groups.dp_size > 1:
        dist.all_reduce(counts, group=groups.pg.dp)
    out.meta["global_tokens"], out.meta["global_seqs"] = (max(float(c), 1.0) for c in counts)
    return out


def _causal_mask(seq: int, device) -> Optional[torch.Tensor]:
    """None on GPU (the kernels' own causal masking); on CPU an explicit [1, 1, s, s] mask (True = hidden).

    Why: with activation recompute the forward is replayed inside autograd's backward, where
    megatron_patches' thread-local device mode is suspended (TorchFunctionMode semantics), and
    megatron's default causal mask is built with device="cuda". An explicit mask avoids that call;
    the math is the same causal mask.
    """
    if torch.cuda.is_available():
        return None
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu_(1).view(1, 1, seq, seq)


def _comm_device() -> torch.device:
    """Where small collective buffers live: the current GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _micro_loss(head, loss_fn, mb: MicroBatch, scale: float, store: list, output):
    """Last-stage loss of one micro-batch, times `scale` = DP size × micro-batches (the same at any CP).

    Why that scale gives the cp=1 gradient. Let L_d = Σ_mb loss_{d,mb} be DP rank d's share of the
    step loss (global denominators, so Σ_d L_d is the step loss L). With the 2-tuple loss_func,
    megatron's `forward_step_calc_loss` back-propagates loss · scale · cp / n_mb; DDP pre-scales every
    gradient by 1 / |dp_cp group| = 1 / (dp · cp) and sums it over dp_cp. CP rank c of DP rank d
    computes the whole micro-batch loss (heads gather outputs over CP) but its backward covers only
    its own tokens, g_{d,c} = ∂_c loss_{d,mb}, with Σ_c g_{d,c} = ∇ loss_{d,mb} (TE's attention backward
    returns K/V gradients to their owners). So the reduced gradient is
        Σ_{d,c,mb} (dp · n_mb) · cp / n_mb / (dp · cp) · g_{d,c} = Σ_{d,mb} ∇ loss_{d,mb} = ∇L,
    for every DP size, CP size and micro-batch split (at cp = 1 the same line with cp = 1).
    """
    outputs = head(output, mb)
    if loss_fn is None:
        store.append((mb, {k: v.detach().float().cpu() for k, v in outputs.items()}))
        return output.new_zeros(()), {}
    loss, stats = loss_fn(outputs, mb)
    weight = float(mb.batch["response_mask"].sum()) if "response_mask" in mb.batch else float(len(mb.rows))
    store.append((loss.detach(), {k: torch.as_tensor(v).detach().float() for k, v in stats.items()}, weight))
    return loss * scale, {}


def _assemble(store: list, rows: int) -> dict:
    """Per-micro-batch outputs back into one [B, T] tensor per name, in the batch's row order."""
    names = store[0][1].keys()
    out = {}
    for name in names:
        first = store[0][1][name]
        full = first.new_zeros((rows, *first.shape[1:]))
        for mb, values in store:
            full[torch.as_tensor(mb.rows)] = values[name]
        out[name] = full
    return out


def _reduce_stats(store: list) -> dict:
    """Loss summed over micro-batches; stats as weighted sums (weight: response tokens), except stats
    named `*_max`, which are maxima."""
    sums = {"loss": sum(float(loss) for loss, _, _ in store), "_weight": sum(w for _, _, w in store)}
    for _, stats, weight in store:
        for key, value in stats.items():
            if key.endswith("_max"):
                sums[key] = max(sums.get(key, float("-inf")), float(value))
            else:
                sums[key] = sums.get(key, 0.0) + float(value) * weight
    return sums


def _all_reduce_stats(sums: dict, dp_group) -> dict:
    """The step's stats over DP: token-weighted means, maxima for `*_max`, the summed loss."""
    total = {}
    for op, keys in (
        (dist.ReduceOp.SUM, sorted(k for k in sums if not k.endswith("_max"))),
        (dist.ReduceOp.MAX, sorted(k for k in sums if k.endswith("_max"))),
    ):
        if not keys:
            continue
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=_comm_device())
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(values, op=op, group=dp_group)
        total.update(zip(keys, values.tolist()))
    weight = max(total.pop("_weight"), 1e-12)
    return {k: (v if k == "loss" or k.endswith("_max") else v / weight) for k, v in total.items()}


def _broadcast_from_last_stage(value, groups: RoleGroups):
    """The last pipeline stage's value on every stage (pickled; outputs are [B, T], small)."""
    if groups.layout.pp == 1:
        return value
    box = [value]
    src = dist.get_global_rank(groups.pg.pp, groups.layout.pp - 1)
    dist.broadcast_object_list(box, src=src, group=groups.pg.pp)
    return box[0]
