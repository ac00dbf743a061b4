"""HF ↔ megatron-core distributed-checkpoint conversion at any TP/PP/VPP/EP layout.

Owns: `hf_to_mcore` and `mcore_to_hf` (validated up front, run on a spawned local world or under
torchrun; a dense model's single-rank export runs in this process, `export_in_process`), and the
megarl checkpoint metadata (`megarl_checkpoint.json`, written last, so a directory without it is
never taken for a checkpoint). Every rank holds only its own shard plus one full tensor at a time.

Layout of a megarl megatron checkpoint directory:
    common.pt, .metadata, __*.distcp   megatron-core torch_dist checkpoint (layout-independent)
    hf/                                config.json, generation config and tokenizer files
    megarl_checkpoint.json             format, model type, dtype, layout it was written from
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megarl.models import dcp_export, dcp_save
from megarl.models.hf_config import describe_hf_config, load_hf_config
from megarl.models.hf_io import (
    CheckpointError,
    HFCheckpointReader,
    HFShardWriter,
    copy_hf_side_files,
    record_dtype,
    write_index,
)
from megarl.models.layout import ParallelLayout
from megarl.models.weight_map import WeightMap
from megarl.utils.atomic import atomic_directory, check_target, publish_collective, shared_staging_dir

MARKER = "megarl_checkpoint.json"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ConversionPlan:
    """Everything a rank needs; built and validated in the launching process."""

    src: str
    dst: str
    layout: ParallelLayout
    dtype: str
    overwrite: bool

    @property
    def world_size(self) -> int:
        return self.layout.min_world_size


def _dtype_name(hf_config, requested: Optional[str]) -> str:
    if requested:
        if requested not in _DTYPES:
            raise ValueError(f"--dtype {requested!r} is not one of {sorted(_DTYPES)}")
        return requested
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    name = str(dtype).replace("torch.", "")
    return name if name in _DTYPES else "float32"


def plan_hf_to_mcore(
    hf_path, mcore_path, layout: ParallelLayout, *, dtype: Optional[str] = None, overwrite: bool = False
) -> ConversionPlan:
    """Validate inputs before any weight is read: config, layout, weight files, target directory."""
    hf_config = load_hf_config(hf_path)
    dims = describe_hf_config(hf_config)
    layout.check_dims(dims)
    HFCheckpointReader(hf_path)  # raises on missing / corrupt index or weight files
    _check_distinct(hf_path, mcore_path, "--hf-path", "--mcore-path")
    check_target(mcore_path, overwrite)
    return ConversionPlan(str(hf_path), str(mcore_path), layout, _dtype_name(hf_config, dtype), overwrite)


def _check_distinct(src, dst, src_flag: str, dst_flag: str) -> None:
    """The target must not be the source or hold it (or sit inside it): --overwrite would replace the source."""
    src_abs, dst_abs = Path(src).resolve(), Path(dst).resolve()
    if src_abs == dst_abs or src_abs in dst_abs.parents or dst_abs in src_abs.parents:
        relation = "is" if src_abs == dst_abs else "overlaps"
        raise ValueError(
            f"{dst_flag} {dst} {relation} the source {src_flag} {src}: writing the result there would"
            f" replace the weights being converted; pick another {dst_flag}"
        )


def read_metadata(mcore_path) -> dict:
    """The megarl metadata of a complete megatron checkpoint (raises on incomplete / foreign dirs)."""
    path = Path(mcore_path)
    if not path.is_dir():
        raise FileNotFoundError(f"megatron checkpoint directory {path} does not exist")
    marker = path / MARKER
    roles = sorted(p.name for p in path.iterdir() if (p / MARKER).is_file()) if not marker.is_file() else []
    if roles:  # a trainer's step directory: one checkpoint per role
        raise CheckpointError(
            f"{path} is a trainer's step directory holding the checkpoints {roles}, not one checkpoint;"
            f" pass one of them, e.g. --mcore-path {path / roles[0]}"
        )
    if not marker.is_file():
        raise CheckpointError(
            f"{path} has no {MARKER}: it is not a complete megarl checkpoint (an interrupted"
            " conversion or save leaves no marker); convert or save it again"
        )
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{marker} is corrupt ({err})") from err


def plan_mcore_to_hf(
    mcore_path, hf_path, layout: ParallelLayout = ParallelLayout(), *, overwrite: bool = False
) -> ConversionPlan:
    meta = read_metadata(mcore_path)
    hf_config = load_hf_config(Path(mcore_path) / "hf")
    dims = describe_hf_config(hf_config)
    layout.check_dims(dims)
    _check_distinct(mcore_path, hf_path, "--mcore-path", "--hf-path")
    check_target(hf_path, overwrite)
    if dcp_export.has_value_head(mcore_path):
        raise CheckpointError(
            f"{mcore_path} is a value model's checkpoint (a critic or reward model: its output layer is a value"
            " head of one row); mcore-to-hf exports causal language models: pass the actor's checkpoint"
        )
    # a conversion's marker names its dtype; a trainer's checkpoint (kind "train-state") stores the training dtype
    dtype = meta.get("dtype") or dcp_export.stored_dtype(mcore_path)
    return ConversionPlan(str(mcore_path), str(hf_path), layout, dtype, overwrite)


def run_plan(fn, plan: ConversionPlan, *, share_threads: bool = False):
    """Run a per-rank conversion function under torchrun (if launched so) or on spawned local ranks.

    share_threads: the local ranks split this process's torch threads. For hf→mcore, where every rank
    does the same work: at torch's default (every core each), two TP2 ranks on two cores spent 0.35–0.72 s
    reading their halves, against 0.20–0.25 s at one thread each. Not for mcore→hf, whose rank 0 writes
    the whole HF checkpoint."""
    from megarl.utils import distributed

    if distributed.in_launched_world():
        distributed.init_process_group_from_env()
        return fn(plan)
    threads = max(1, torch.get_num_threads() // plan.world_size) if share_threads else None
    return distributed.run_distributed(fn, plan.world_size, plan, num_threads=threads)[0]


def hf_to_mcore(hf_path, mcore_path, layout: ParallelLayout = ParallelLayout(), **kwargs) -> dict:
    """Convert an HF checkpoint into a megatron-core distributed checkpoint; returns its metadata."""
    return run_plan(hf_to_mcore_rank, plan_hf_to_mcore(hf_path, mcore_path, layout, **kwargs), share_threads=True)


def mcore_to_hf(mcore_path, hf_path, layout: ParallelLayout = ParallelLayout(), **kwargs) -> dict:
    """Convert a megatron-core distributed checkpoint back to HF safetensors; returns a summary.

    A dense model read at the single-rank layout outside torchrun is exported in this process without
    megatron-core (`dcp_export`); other models and layouts load into megatron models on local ranks."""
    plan = plan_mcore_to_hf(mcore_path, hf_path, layout, **kwargs)
    if dcp_export.applies(plan):
        return export_in_process(plan)
    return run_plan(mcore_to_hf_rank, plan)


def export_in_process(plan: ConversionPlan) -> dict:
    """mcore→hf of a dense model in this process, read without megatron-core (`dcp_export`): the same
    files, marker and summary as the ranks' export (`mcore_to_hf_rank`), published atomically."""
    from tqdm import tqdm

    src = Path(plan.src)
    weight_map = WeightMap(describe_hf_config(load_hf_config(src / "hf")))
    bar = tqdm(total=len(weight_map.hf_names()), desc="mcore→hf", unit="tensor", leave=False)
    with bar, atomic_directory(plan.dst, MARKER, plan.overwrite) as staging:
        writer = HFShardWriter(staging)
        for name, tensor in dcp_export.hf_weights(src, weight_map):
            writer.add(name, tensor)
            bar.update()
        writer.flush()
        missing = sorted(set(weight_map.hf_names()) - set(writer.weight_map))
        if missing:
            raise CheckpointError(f"{src} lacks {len(missing)} model parameters, e.g. {missing[:5]}")
        write_hf_metadata(staging, writer.weight_map, writer.total_bytes, writer.dtypes, side_files_from=src / "hf")
        (staging / MARKER).write_text(json.dumps(_export_marker(plan), indent=2))
    return _export_summary(writer.weight_map, writer.total_bytes)


def _export_marker(plan: ConversionPlan) -> dict:
    return {"format_version": FORMAT_VERSION, "kind": "hf-export", "source": plan.src}


# ----------------------------------------------------------------------------- per-rank work


def sharded_model_state(chunks) -> dict:
    """The sharded state dict of a rank's model chunks, keyed like Megatron-LM ("model" / "model{i}")."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def load_model_state(chunks, state: dict) -> None:
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        missing, unexpected = chunk.load_state_dict(state[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"checkpoint lacks parameters {missing[:5]}")


def _cleanup_on_error(staging: Optional[Path]) -> None:
    import torch.distributed as dist

    if staging is not None and dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)


def _progress(total: int, desc: str):
    import torch.distributed as dist
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=dist.get_rank() != 0, leave=False)


def _build(plan: ConversionPlan, hf_config_dir):
    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import init_megatron, ranks

    init_megatron(plan.layout)
    bridge = ModelBridge.from_hf_path(hf_config_dir, plan.layout, dtype=_DTYPES[plan.dtype])
    tp_rank, pp_rank, _ = ranks()
    # No random init: every parameter is overwritten by the checkpoint being converted (a parameter the
    # checkpoint lacks fails the load). megatron's CPU init of a 120M model is 1.0 s per rank.
    config = bridge.transformer_config(perform_initialization=False)
    return bridge, bridge.build(pp_rank, config=config), tp_rank, pp_rank


def _ep_rank() -> int:
    from megarl.models.runtime import expert_ranks

    return expert_ranks()[0]


def hf_to_mcore_rank(plan: ConversionPlan) -> dict:
    staging = None
    try:
        bridge, chunks, tp_rank, pp_rank = _build(plan, plan.src)
        n_params = sum(1 for c in chunks for _ in c.parameters())
        start = time.perf_counter()
        with _progress(n_params, "hf→mcore") as bar:
            bridge.load_hf_weights(
                chunks, plan.src, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=_ep_rank(), progress=lambda _: bar.update()
            )
        loaded = time.perf_counter()
        staging = shared_staging_dir(Path(plan.dst))
        dcp_save.save(sharded_model_state(chunks), staging)
        meta = {
            "format_version": FORMAT_VERSION,
            "kind": "model",
            "model_type": bridge.dims.model_type,
            "dtype": plan.dtype,
            "written_with_layout": dataclasses.asdict(plan.layout),
            "source": plan.src,
        }
        if torch.distributed.get_rank() == 0:
            copy_hf_side_files(Path(plan.src), staging / "hf")
        publish_collective(staging, Path(plan.dst), MARKER, meta)
        return {**meta, "seconds": {"load": loaded - start, "save": time.perf_counter() - loaded}}
    except BaseException:
        _cleanup_on_error(staging)
        raise


def write_hf_shards(
    staging: Path, weights, *, writes: bool, pp_rank: int, pp_size: int, side_files_from, progress=None
) -> dict:
    """Collective: every rank drains its stage's (HF name, tensor) stream; the `writes` rank of each
    stage stores them as safetensors shards; rank 0 writes the index and the config/tokenizer files."""
    import torch.distributed as dist

    writer = HFShardWriter(staging, prefix=f"model-pp{pp_rank:03d}" if pp_size > 1 else "model")
    for name, tensor in weights:
        if writes:
            writer.add(name, tensor)
        if progress:
            progress()
    writer.flush()
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, (writer.weight_map, writer.total_bytes, writer.dtypes) if writes else ({}, 0, set()))
    weight_map, total_bytes = {k: v for m, _, _ in maps for k, v in m.items()}, sum(b for _, b, _ in maps)
    if dist.get_rank() == 0:
        dtypes = set().union(*(d for _, _, d in maps))
        write_hf_metadata(staging, weight_map, total_bytes, dtypes, side_files_from=side_files_from)
    return _export_summary(weight_map, total_bytes)


def write_hf_metadata(staging: Path, weight_map: dict, total_bytes: int, dtypes, *, side_files_from) -> None:
    """What an HF export holds beside its shards: the index, the config and tokenizer files, the config
    naming the dtype the shards were written in."""
    write_index(staging, weight_map, total_bytes)
    copy_hf_side_files(side_files_from, staging)
    record_dtype(staging, dtypes)


def _export_summary(weight_map: dict, total_bytes: int) -> dict:
    return {"tensors": len(weight_map), "bytes": total_bytes, "format_version": FORMAT_VERSION}


def mcore_to_hf_rank(plan: ConversionPlan) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megarl.models.runtime import expert_ranks

    staging = None
    try:
        bridge, chunks, tp_rank, pp_rank = _build(plan, Path(plan.src) / "hf")
        load_model_state(chunks, dist_checkpointing.load(sharded_model_state(chunks), plan.src))
        staging = shared_staging_dir(Path(plan.dst))
        writes = tp_rank == 0 and ps.get_data_parallel_rank() == 0
        weights = bridge.iter_hf_weights(
            chunks, pp_rank=pp_rank, tp_group=ps.get_tensor_model_parallel_group(), ep_group=expert_ranks()[1]
        )
        with _progress(bridge.count_hf_tensors(chunks, pp_rank), "mcore→hf") as bar:
            summary = write_hf_shards(
                staging,
                weights,
                writes=writes,
                pp_rank=pp_rank,
                pp_size=plan.layout.pp,
                side_files_from=Path(plan.src) / "hf",
                progress=bar.update,
            )
        publish_collective(staging, Path(plan.dst), MARKER, _export_marker(plan))
        return summary
    except BaseException:
        _cleanup_on_error(staging)
        raise
