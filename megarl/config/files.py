"""Checks of the files a `RunConfig` names, run by `validate` unless check_paths=False: data and
validation files (exist, have the configured columns), the tokenizer, the resume target, each role's
HF model (config.json present; its layout fits the model's layers and heads; the rollout TP and
context fit the policy). Also the rollout engine's context length. Imports no megatron, vLLM or Ray.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megarl.config.loader import ConfigError
from megarl.config.schema import RESUME_MODES, RunConfig
from megarl.models.layout import LayoutError


def check_files(cfg: RunConfig) -> None:
    for where, paths in (("data.files", cfg.data.files), ("validation.files", cfg.validation.files)):
        for path in paths:
            if not os.path.exists(path):
                raise ConfigError(
                    f"{where}: {path!r} does not exist (cwd {os.getcwd()}); fix the path, or pass"
                    " --no-check-paths if it only exists on the cluster"
                )
            _check_columns(cfg, where, path)
    tokenizer = cfg.model.tokenizer_path or cfg.model.hf_path
    if os.path.isdir(tokenizer) and not any(os.path.isfile(os.path.join(tokenizer, name)) for name in TOKENIZER_FILES):
        raise ConfigError(
            f"no tokenizer in {tokenizer!r} (none of {', '.join(TOKENIZER_FILES)}); set"
            " model.tokenizer_path to the tokenizer's directory"
        )
    resume = cfg.trainer.resume
    if resume not in RESUME_MODES and not os.path.exists(resume):
        raise ConfigError(f"trainer.resume={resume!r} is neither auto, never nor an existing checkpoint path")
    for where, path in _model_paths(cfg).items():
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"{where}={path!r} has no config.json; point it at a HuggingFace checkpoint"
                " directory (or pass --no-check-paths if it only exists on the cluster)"
            )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _file_columns(path: str) -> Optional[list[str]]:
    """Column names read cheaply (parquet schema, first jsonl row); None where that is not cheap."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception:  # noqa: BLE001 -- not parquet: the dataset reports the file
            return None
    if path.endswith(".jsonl"):
        with open(path, errors="replace") as f:  # not UTF-8: the dataset reports the line
            first = next((line for line in f if line.strip()), None)
        try:
            row = json.loads(first) if first else None
        except json.JSONDecodeError:
            return None  # the dataset reports the bad line with its number
        return list(row) if isinstance(row, dict) else None
    return None


def _check_columns(cfg: RunConfig, where: str, path: str) -> None:
    columns = _file_columns(path)
    if columns is None:
        return
    for key in ("prompt_key", "ground_truth_key"):
        column = getattr(cfg.data, key)
        if column is not None and column.split(".")[0] not in columns:
            raise ConfigError(
                f"{where}: {path!r} has no column {column.split('.')[0]!r} (data.{key}={column!r});"
                f" columns: {columns}. Set data.{key} to the right column"
            )


def _model_paths(cfg: RunConfig) -> dict[str, str]:
    paths = {"model.hf_path": cfg.model.hf_path}
    for role in ("critic", "ref", "reward_model"):
        path = getattr(cfg, role).hf_path
        if path:
            paths[f"{role}.hf_path"] = path
    tokenizer = cfg.model.tokenizer_path
    if tokenizer and not os.path.isdir(tokenizer):
        raise ConfigError(f"model.tokenizer_path={tokenizer!r} is not a directory")
    return paths


def _role_model_path(cfg: RunConfig, role: str) -> str:
    own = None if role == "actor" else getattr(cfg, role).hf_path
    return own or cfg.model.hf_path


def check_models(cfg: RunConfig, roles: tuple[str, ...]) -> None:
    """Each role's layout against its model's layers/heads; the rollout TP; prompt + response vs context."""
    from megarl.models.hf_config import describe_hf_config, load_hf_config

    dims_by_path = {}
    for role in roles:
        path = _role_model_path(cfg, role)
        if path not in dims_by_path:
            try:
                dims_by_path[path] = describe_hf_config(load_hf_config(path))
            except (ValueError, FileNotFoundError) as err:
                raise ConfigError(f"{role} model {path}: {err}") from None
    check_layouts_fit(
        cfg, {role: dims_by_path[_role_model_path(cfg, role)] for role in roles}, dims_by_path[cfg.model.hf_path]
    )


def check_layouts_fit(cfg: RunConfig, role_dims: dict, policy_dims) -> None:
    """Each role's layout against its model's `ModelDims` and the rollout TP against the policy's
    (the divisibility rules `megarl plan --search` enumerates with); `ConfigError` naming the field."""
    for role, dims in role_dims.items():
        try:
            getattr(cfg, role).layout.check_dims(dims)
        except LayoutError as err:
            raise ConfigError(f"{role}.layout does not fit {_role_model_path(cfg, role)}: {err}") from None
    _check_rollout_model(cfg, policy_dims)


def _check_rollout_model(cfg: RunConfig, dims) -> None:
    tp = cfg.rollout.tp
    if dims.num_heads % tp or (dims.num_kv_heads % tp and tp % dims.num_kv_heads):
        raise ConfigError(
            f"rollout.tp={tp} does not fit the model's num_attention_heads={dims.num_heads} /"
            f" num_key_value_heads={dims.num_kv_heads}: tp must divide the heads and divide"
            " (or be a multiple of) the KV heads"
        )
    context = cfg.rollout.max_model_len or cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    needed = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    if needed > context or context > dims.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_response_tokens = {cfg.data.max_prompt_tokens} +"
            f" {cfg.rollout.max_response_tokens} = {needed} must fit in rollout.max_model_len={context}"
            f" <= the model's max_position_embeddings={dims.max_position_embeddings}; shorten them"
        )


def resolve_max_model_len(cfg: RunConfig) -> int:
    """The rollout engine's context length (rollout.max_model_len, or prompt + response budget)."""
    return cfg.rollout.max_model_len or cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens


__all__ = ["check_files", "check_layouts_fit", "check_models", "resolve_max_model_len"]
