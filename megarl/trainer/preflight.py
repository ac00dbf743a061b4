"""Pre-flight checks of `megarl train`: what can be checked from local files, after the config is
validated and the data loaded, and before Ray starts or anything is written to the run directory.

Owns `preflight(cfg, data) -> ResumePlan`, which raises `ConfigError` (one line, naming the field
and the fix) when
* `trainer.run_dir` is a file, under a file, or not writable;
* a model directory (`model.hf_path`, `critic/ref/reward_model.hf_path`) has no safetensors
  weights, or a safetensors file whose header does not parse or promises more bytes than the file
  holds (truncated);
* `resources.accelerator=gpu` on a local run where torch sees fewer GPUs than a node needs;
* `trainer.resume` cannot be honoured (`megarl.trainer.state.plan_resume`: an incomplete or damaged
  explicit checkpoint, named with the one to use instead), or its step is past `trainer.total_steps`,
  or a role checkpoint of it was saved with DP-sharded optimizer state at another TP/PP/VPP/CP/EP;
* a `data_source` of the training or validation data maps to no reward function.

A damaged latest checkpoint under resume=auto is not an error here: the loop reports it and resumes
from the previous intact one. Imports torch, no megatron, vLLM or Ray.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Optional

from megarl.config.loader import ConfigError
from megarl.trainer.state import ResumeError, ResumePlan, plan_resume

_MAX_HEADER_BYTES = 100 << 20


def preflight(cfg, data) -> ResumePlan:
    """Every check above; the checkpoint the run will continue from (see the module docstring)."""
    check_run_dir(cfg.trainer.run_dir)
    for where, path in model_paths(cfg).items():
        check_weights(where, path)
    check_accelerator(cfg.resources)
    check_data_sources(cfg, data)
    return check_resume(cfg)


# ----------------------------------------------------------------------------- run directory


def check_run_dir(run_dir: str) -> None:
    """The run directory exists as a writable directory, or can be created (nothing is left behind)."""
    path = Path(run_dir).absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise ConfigError(f"trainer.run_dir={run_dir!r} {where}; point trainer.run_dir at a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise ConfigError(
            f"trainer.run_dir={run_dir!r} {what}: {err.strerror or err}; pick a writable trainer.run_dir"
        ) from None


# ----------------------------------------------------------------------------- weights


def model_paths(cfg) -> dict[str, str]:
    """{field: HF directory} of every model the active roles load."""
    from megarl.config.validate import active_roles

    roles = active_roles(cfg)
    paths = {"model.hf_path": cfg.model.hf_path}
    for role in ("critic", "ref", "reward_model"):
        own = getattr(cfg, role).hf_path
        if role in roles and own:
            paths[f"{role}.hf_path"] = own
    return paths


def safetensors_files(where: str, path: str) -> list[Path]:
    """The weight files of an HF directory (its index's shards, or every *.safetensors)."""
    from megarl.models.hf_io import INDEX_FILE

    directory = Path(path)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{where}={path!r}: {index} is unreadable ({err}); re-export the checkpoint") from None
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ConfigError(f"{where}={path!r}: {INDEX_FILE} lists shards that are missing: {missing}")
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        raise ConfigError(
            f"{where}={path!r} has no safetensors weights (found {found}); point it at an HF"
            " checkpoint directory with model.safetensors (convert .bin weights with"
            " save_pretrained(safe_serialization=True))"
        )
    return files


def check_weights(where: str, path: str) -> None:
    for file in safetensors_files(where, path):
        problem = safetensors_problem(file)
        if problem:
            raise ConfigError(f"{where}={path!r}: {file.name} {problem}; re-download or re-export the checkpoint")


def safetensors_problem(file: Path) -> Optional[str]:
    """What is wrong with a safetensors file's header (reads only the header), or None."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, no header)"
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            return f"is not a safetensors file or is truncated (header length {length}, file {size} bytes)"
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            return f"has an unreadable header ({type(err).__name__}: {err})"
    if 8 + length + end > size:
        return f"is truncated: its header needs {8 + length + end} bytes, the file has {size}"
    return None


# ----------------------------------------------------------------------------- accelerator, resume, data


def check_accelerator(res) -> None:
    """A local GPU run needs the GPUs of one node here (a joined Ray cluster brings its own)."""
    if res.accelerator != "gpu" or res.ray_address:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < res.gpus_per_node:
        raise ConfigError(
            f"resources.accelerator=gpu with resources.gpus_per_node={res.gpus_per_node}, but this"
            f" machine has {found} usable CUDA GPU(s); set resources.accelerator=cpu, lower"
            " resources.gpus_per_node, or join a GPU cluster with resources.ray_address"
        )


def check_resume(cfg) -> ResumePlan:
    tr = cfg.trainer
    try:
        plan = plan_resume(tr.resume, tr.run_dir)
    except ResumeError as err:
        raise ConfigError(str(err)) from None
    if plan.step > tr.total_steps:
        raise ConfigError(
            f"trainer.total_steps={tr.total_steps} but the checkpoint to resume from, {plan.directory},"
            f" is at step {plan.step}; raise trainer.total_steps to train further, or start a new run"
            " (another trainer.run_dir, or trainer.resume=never)"
        )
    if plan.directory is not None:
        check_resume_layouts(cfg, plan.directory)
    return plan


def check_resume_layouts(cfg, directory: Path) -> None:
    """A role checkpoint whose optimizer state was saved DP-sharded resumes only at its TP/PP/VPP/CP/EP."""
    from dataclasses import asdict

    from megarl.engine.checkpoint import fixed_layout_changes
    from megarl.models.convert import MARKER

    for role in ("actor", "critic"):
        marker, role_cfg = Path(directory) / role / MARKER, getattr(cfg, role, None)
        if role_cfg is None or not marker.is_file():
            continue
        changes = fixed_layout_changes(json.loads(marker.read_text()), asdict(role_cfg.layout))
        if changes:
            raise ConfigError(
                f"{role}.layout: the checkpoint to resume from, {marker.parent}, holds the optimizer state"
                f" DP-sharded (saved with trainer.checkpoint_reshardable=false), which loads only at the"
                f" TP/PP/VPP/CP/EP it was saved at; this run changes {', '.join(changes)}: resume at that"
                f" layout (any DP size), then save with trainer.checkpoint_reshardable=true to change it"
            )


def check_data_sources(cfg, data) -> None:
    """Every data_source of the prompts has a reward (reward.reward_fn, the built-in names and aliases,
    or reward.data_source_rewards; a reward.batch_reward_fn scores every source)."""
    if cfg.reward.reward_fn is not None or cfg.reward.batch_reward_fn is not None:
        return  # validated by megarl.config.validate
    from megarl.rewards import get_reward_fn, list_rewards
    from megarl.rewards.registry import DATA_SOURCE_ALIASES

    mapping = {**DATA_SOURCE_ALIASES, **cfg.reward.data_source_rewards}
    for where, sources in _data_sources(cfg, data).items():
        for source in sorted(sources, key=str):
            try:
                get_reward_fn(mapping.get(source, source))
            except (ValueError, TypeError):
                default = (
                    f" (rows without a {cfg.data.data_source_key!r} column get data.default_data_source)"
                    if source == cfg.data.default_data_source
                    else ""
                )
                raise ConfigError(
                    f"{where}: data_source {source!r}{default} has no reward function; set"
                    f" reward.reward_fn, or map it with reward.data_source_rewards={{{source}: <reward>}}"
                    f" (rewards: {', '.join(list_rewards())})"
                ) from None


def _data_sources(cfg, data) -> dict[str, set]:
    found = {"data.files": {row["data_source"] for row in data.loader.dataset.rows}}
    if data.validation is not None:
        found["validation.files"] = set(data.validation["data_source"])
    return found
