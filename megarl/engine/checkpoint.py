"""Training checkpoints of an engine (model, optimizer, LR scheduler, RNG, step) and HF export.

Owns: `save_checkpoint` (optionally asynchronous, completed by `finish_checkpoint`), `load_checkpoint`
and `export_hf`. Checkpoints go through megatron-core
`dist_checkpointing` (torch_dist): the model's sharded state dict plus the distributed optimizer's
`fully_reshardable` state, so a checkpoint written at one TP/PP/DP/EP layout loads at another (or, with
`reshardable=False`, its `dp_reshardable` state: at another DP size only).
The RNG states are per rank and are restored only when the layout and world size are unchanged
(a different layout has different ranks; the RNG matters only for dropout, which is 0 here).

Writes are atomic: every rank writes into a hidden staging directory next to the target, rank 0
writes `megarl_checkpoint.json` (the marker) last and renames the directory into place, so a
crash mid-save never leaves a directory that looks complete (and never harms an older one).
An asynchronous save (`wait=False`) copies the state and returns; its files are written on a thread
while training goes on, and `finish_checkpoint` (collective) publishes it the same way once they are.

Saving and loading are collective over the whole torch.distributed world (dist_checkpointing's
default), so the role must span every rank. Must not import vLLM or Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarl.models import dcp_save
from megarl.models.convert import MARKER, read_metadata, write_hf_shards
from megarl.models.hf_io import CheckpointError, copy_hf_side_files
from megarl.utils.atomic import check_target, publish_collective, shared_staging_dir

FORMAT_VERSION = 1
# 'fully_reshardable' loads at any TP/PP/DP. (megatron-core 0.19.2's default, 'fully_sharded_model_space',
# fails: it still passes `flattened_range`, which 0.19.2's ShardedTensor rejects.)
# 'chained_optim_avoid_prefix' keys every optimizer tensor by its parameter alone. Without it a
# MoE model's tensors are named 'chained_<i>.' after the megatron optimizer holding them, and that
# depends on EP: at EP>1 megatron chains two distributed optimizers (dense parameters, then the
# experts), at EP1 the experts are ordinary parameters of a single one. See `_regroup_optimizer_state`.
RESHARDABLE, DP_SHARDED = "fully_reshardable", "dp_reshardable"
"""The distributed optimizer's checkpoint formats megarl writes (megatron-core's sharding types):
RESHARDABLE loads at any TP/PP/EP/DP layout, but megatron-core gathers every DP rank's optimizer shard onto
each rank of the DP group to write it (3 all-gathers and buffers of the whole TP/PP shard's state: 5.4 s of
a 6.5 s save of a 64M-parameter model at DP2 on 2 CPU cores); DP_SHARDED writes each rank's shard as it
holds it (no communication, no copy: 0.75 s there) and loads at any DP size with the same TP/PP/VPP/CP/EP."""
FIXED_BY_DP_SHARDED = ("tp", "pp", "vpp", "cp", "ep")


def _optim_metadata(optimizer_format: str) -> dict:
    return {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True}


def fixed_layout_changes(meta: dict, layout: dict) -> list[str]:
    """What a resume at `layout` would change that a checkpoint with DP-sharded optimizer state cannot load
    at ("tp 2 -> 1", ...); empty when it loads (or its optimizer state is reshardable, or it has none)."""
    if meta.get("optimizer_format", RESHARDABLE) != DP_SHARDED or not meta.get("has_optimizer", True):
        return []
    saved = meta.get("layout", {})
    return [
        f"{k} {saved.get(k, 1)} -> {layout.get(k, 1)}"
        for k in FIXED_BY_DP_SHARDED
        if saved.get(k, 1) != layout.get(k, 1)
    ]


def check_optimizer_layout(meta: dict, layout: dict, path: str) -> None:
    changes = fixed_layout_changes(meta, layout)
    if changes:
        raise CheckpointError(
            f"{path}: its optimizer state was saved DP-sharded (reshardable=False), which loads only at the"
            f" TP/PP/VPP/CP/EP it was saved at, and this engine's differ ({', '.join(changes)}); load it at"
            " that layout (any DP size)"
        )


def _model_state(engine) -> dict:
    # CP ranks are weight replicas, like DP ranks: replica ids come from the dp_cp group (one writer per shard).
    metadata = {"dp_cp_group": engine.groups.pg.dp_cp}
    chunks = engine.chunks
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(value):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", value, (world,), (rank,), replica_id=0)


def _init_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its per-parameter state (step, moments) so megatron can build the
    loading state dict: with torch's Adam (no TE/apex) megatron-core 0.19.2 reads `state[p]["step"]`
    of every parameter and asserts before the first step has created it."""
    from megarl.engine.offload import inner_optimizers

    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # TE / apex FusedAdam keep no per-parameter step
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state.update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(param.data),
                        exp_avg_sq=torch.zeros_like(param.data),
                    )


def _distributed_optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in chained if hasattr(o, "_set_main_param_and_optimizer_states")]


@contextlib.contextmanager
def _torch_adam_step_fix(optimizer):
    """Work around megatron-core 0.19.2 loading distributed-optimizer state into torch's Adam (both formats).

    `_set_main_param_and_optimizer_states` copies every tensor of the parameter's Adam state,
    including torch Adam's per-parameter `step`, from a source that (by design) has no `step`
    (it is restored from the param groups) and raises KeyError. While loading, each call hides
    `step` from the state it copies into and puts it back after. Megatron also restores one
    `step` tensor shared by every parameter, which torch's Adam would then increment once per
    parameter per step: each parameter gets its own copy afterwards. TE/apex FusedAdam (GPU) keeps
    no per-parameter step and never takes this path. Remove when megatron handles both.
    """
    patched = _distributed_optimizers(optimizer)
    for dist_opt in patched:
        dist_opt._set_main_param_and_optimizer_states = functools.partial(_set_states_without_step, dist_opt)
    try:
        yield
    finally:
        for dist_opt in patched:
            del dist_opt._set_main_param_and_optimizer_states
        _unshare_steps(optimizer)


def _unshare_steps(optimizer) -> None:
    from megarl.engine.offload import inner_optimizers

    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _set_states_without_step(dist_opt, model_param, tensors):
    group_index, group_order = dist_opt.model_param_group_index_map[model_param]
    main_param = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
    state = dist_opt.optimizer.state[main_param]
    step = state.pop("step", None)
    try:
        type(dist_opt)._set_main_param_and_optimizer_states(dist_opt, model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _group_key(group: dict, *, with_ep: bool) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k) for k in param_group_identifier_keys if with_ep or k != "is_expert_parallel")


def _saved_group(group: dict, saved_groups: list) -> dict:
    """The saved param group that `group` (this optimizer's) continues: same identifier keys (lr, min_lr,
    weight decay, ...), preferring the same `is_expert_parallel`. Raises KeyError when none matches."""
    for with_ep in (True, False):
        for saved in saved_groups:
            if _group_key(saved, with_ep=with_ep) == _group_key(group, with_ep=with_ep):
                return {**saved, "is_expert_parallel": group.get("is_expert_parallel")}
    raise KeyError(_group_key(group, with_ep=True))


def _regroup_optimizer_state(optimizer, loaded: dict):
    """Give the loaded optimizer state this optimizer's structure, whatever EP it was saved at.

    A chained optimizer's state is {0: dense, 1: experts}, a single one's is the dict itself; each
    holds "optimizer" (param groups, saved by rank 0 into the common state) and "param_state" (the
    tensors, loaded in *this* structure). dist_checkpointing merges the saved common state into the
    loaded tensors key by key, so after an EP change the param groups sit in the saved structure and
    the tensors in ours. Every param group of ours takes the saved group with the same identifier keys
    (they differ between EP sizes only in `is_expert_parallel`; the values — lr, step — are shared).
    """
    parts = [loaded] + [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    saved = [part for part in parts if "optimizer" in part]
    saved_groups = [group for part in saved for group in part["optimizer"]["param_groups"]]
    subs = _sub_optimizers(optimizer)
    states = {}
    for i, sub in enumerate(subs):
        here = loaded[i] if len(subs) > 1 else loaded
        groups = [_saved_group(group, saved_groups) for group in sub.optimizer.param_groups]
        states[i] = {
            **{k: v for k, v in saved[0].items() if not isinstance(k, int)},
            "optimizer": {**saved[0]["optimizer"], "param_groups": groups},
            "param_state": here["param_state"],
        }
    return states if len(subs) > 1 else states[0]


def _full_state(engine, *, loading: bool, with_rng: bool, optimizer_format: str = RESHARDABLE) -> dict:
    state = _model_state(engine)
    if engine.optimizer is not None:
        if loading:
            _init_adam_state(engine.optimizer)
        metadata = _optim_metadata(optimizer_format)
        state["optimizer"] = engine.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        state["scheduler"] = engine.scheduler.state_dict()
    state["step"] = engine.step
    if with_rng:
        state["rng_state"] = _rng_object(_rng_state() if not loading else None)
    return state


def _meta(engine, optimizer_format: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "kind": "train-state",
        "step": engine.step,
        "layout": dataclasses.asdict(engine.config.layout),
        "world_size": dist.get_world_size(),
        "has_optimizer": engine.optimizer is not None,
        "optimizer_format": optimizer_format,
        "model_type": engine.bridge.dims.model_type,
    }


def save_checkpoint(engine, path, *, overwrite: bool = True, wait: bool = True, reshardable: bool = True) -> dict:
    """Write model, optimizer, scheduler, RNG and step into `path` atomically (collective); its metadata.

    `reshardable=False`: the optimizer state DP-sharded (`DP_SHARDED`: fast, loads at this TP/PP/VPP/CP/EP
    only). `wait=False`: returns once the state is copied (`dcp_save.save_async`) while this rank's files are
    written on a thread; the checkpoint is published by `finish_checkpoint` (until then `path` does not
    exist). An engine has at most one such save in flight: a new save, a load or an export finishes it first.
    """
    finish_checkpoint(engine, wait=True)
    target = check_target(path, overwrite)
    staging = shared_staging_dir(target)
    optimizer_format = RESHARDABLE if reshardable else DP_SHARDED
    with _removed_on_error(staging):
        if dist.get_rank() == 0:
            copy_hf_side_files(Path(engine.hf_path), staging / "hf")
        meta = _meta(engine, optimizer_format)
        state = _full_state(engine, loading=False, with_rng=True, optimizer_format=optimizer_format)
        if wait:
            dcp_save.save(state, staging)
            publish_collective(staging, target, MARKER, meta)
        else:  # nothing after this may fail on one rank alone: the others would wait for it at the finish
            pending = dcp_save.save_async(state, staging, live=_live_tensors(engine))
            engine.pending_checkpoint = PendingCheckpoint(pending, staging, target, meta)
        return meta


def _live_tensors(engine) -> list:
    """What training changes in place: parameters, gradients, DDP's flat buffers, the optimizer's state, and
    the models' own buffers (`torch.nn.Module.buffers`: DDP's `buffers` attribute shadows the method)."""
    from megarl.engine.offload import model_and_optimizer_tensors

    buffers = [b for chunk in engine.chunks for b in torch.nn.Module.buffers(chunk)]
    return [*model_and_optimizer_tensors(engine.model, engine.optimizer), *buffers]


@dataclasses.dataclass
class PendingCheckpoint:
    """An engine checkpoint whose files are still being written (`save_checkpoint(wait=False)`)."""

    save: "dcp_save.PendingSave"
    staging: Path
    target: Path
    meta: dict


def finish_checkpoint(engine, *, wait: bool = True) -> bool:
    """Publish the engine's checkpoint still being written, if any (collective over the world, like the save).

    True when none is in flight any more (published now, earlier, or never started); False only with
    `wait=False` while some rank is still writing its files (every rank answers the same)."""
    from torch.distributed.checkpoint.api import CheckpointException

    pending = getattr(engine, "pending_checkpoint", None)
    if pending is None:
        return True
    if not wait and not _on_every_rank(pending.save.written()):
        return False
    engine.pending_checkpoint = None
    with _removed_on_error(pending.staging):
        try:
            pending.save.finish()
        except CheckpointException as err:  # a BaseException in torch; its details reach rank 0 only
            raise CheckpointError(
                f"{pending.target}: writing this checkpoint failed on some rank ({err}); it was not published"
                " and earlier checkpoints are untouched"
            ) from err
        publish_collective(pending.staging, pending.target, MARKER, pending.meta)
    return True


def _on_every_rank(flag: bool) -> bool:
    value = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


@contextlib.contextmanager
def _removed_on_error(staging: Path):
    """A save that fails leaves no staging directory behind (rank 0 removes it)."""
    try:
        yield
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def load_checkpoint(engine, path) -> dict:
    """Restore a checkpoint written by `save_checkpoint`, at this engine's layout (any TP/PP/DP/EP; a
    DP-sharded optimizer state: any DP with the saved TP/PP/VPP/CP/EP, refused otherwise before loading)."""
    from megatron.core import dist_checkpointing

    from megarl.models.convert import load_model_state

    finish_checkpoint(engine, wait=True)
    meta, layout = read_metadata(path), dataclasses.asdict(engine.config.layout)
    if engine.optimizer is not None:
        check_optimizer_layout(meta, layout, str(path))
    same_layout = meta["layout"] == layout and meta["world_size"] == dist.get_world_size()
    if engine.optimizer is not None and not meta.get("has_optimizer", True):
        raise ValueError(f"{path} holds no optimizer state; it cannot resume training")
    try:
        state = _full_state(
            engine, loading=True, with_rng=same_layout, optimizer_format=meta.get("optimizer_format", RESHARDABLE)
        )
        loaded = dist_checkpointing.load(state, str(path))
        load_model_state(engine.chunks, loaded)
        if engine.optimizer is not None:
            with _torch_adam_step_fix(engine.optimizer), torch.no_grad():  # dp_reshardable copies into leaves
                engine.optimizer.load_state_dict(_regroup_optimizer_state(engine.optimizer, loaded["optimizer"]))
            engine.scheduler.load_state_dict(loaded["scheduler"])
    except KeyError as err:  # megatron matches optimizer param groups by (lr, min_lr, weight decay, ...)
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups do not match the checkpoint's ({err});"
            " resume with the same OptimConfig (lr, min_lr, weight_decay) it was saved with (and rebuild this"
            " engine: its weights may be half loaded)"
        ) from err
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    engine.step = int(loaded["step"])
    return meta


def export_hf(engine, path, *, overwrite: bool = True) -> dict:
    """Write the engine's weights as an HF safetensors checkpoint (+ config and tokenizer files), atomically."""
    finish_checkpoint(engine, wait=True)
    target = check_target(path, overwrite)
    staging = shared_staging_dir(target)
    groups = engine.groups
    writes = groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0
    summary = write_hf_shards(
        staging,
        engine.hf_weights(),
        writes=writes,
        pp_rank=groups.pp_rank,
        pp_size=engine.config.layout.pp,
        side_files_from=Path(engine.hf_path),
    )
    publish_collective(
        staging, target, MARKER, {"format_version": FORMAT_VERSION, "kind": "hf-export", "step": engine.step}
    )
    return summary
