"""Prompt datasets: files -> validated, chat-templated, tokenised, length-checked prompts -> batches.

Owns `DataConfig`, `load_rows`/`save_rows` (parquet, jsonl, json, HF `save_to_disk` dirs),
`PromptDataset` (all checks happen at construction, before any expensive work: missing files,
missing columns, malformed rows, prompts over the limit), `collate_prompts` (left padding) and
`PromptLoader` (deterministic per-epoch shuffle, resumable at the exact next sample).
Imports torch, numpy and pyarrow only (`datasets` lazily, for HF dirs); no megatron, vLLM or Ray.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.data.schema import ROLLOUT

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("left", "right", "middle", "error")
PRODUCED_COLUMNS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "raw_prompt",
    "ground_truth",
    "data_source",
    "dataset_index",
)


@dataclass
class DataConfig:
    """Where prompts come from and how they become token ids."""

    files: list[str] = field(default_factory=list)
    """Prompt files: .parquet, .jsonl, .json, or directories written by `datasets.save_to_disk`."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of {role, content} chat messages."""
    ground_truth_key: str | None = "ground_truth"
    """Column with the reward's ground truth (dots reach into structs: `reward_model.ground_truth`); None: none."""
    data_source_key: str = "data_source"
    """Column naming each row's source; it picks the reward fn."""
    default_data_source: str = "unknown"
    """data_source of rows from files without the `data_source_key` column."""
    max_prompt_tokens: int = 512
    """Longest prompt, in tokens, after the chat template."""
    truncation: str = "error"
    """What to do with a longer prompt: `left` / `right` (drop tokens there), `middle`, or `error`."""
    filter_overlong: bool = False
    """Drop prompts over `max_prompt_tokens` (and log how many) instead of truncating them."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (+ generation prompt); else tokenise raw strings."""
    split: str = "train"
    """Split to read from an HF `DatasetDict` directory."""
    max_samples: int | None = None
    """Keep only the first this many rows (after filtering); None keeps all."""
    shuffle: bool = True
    """Shuffle the prompt order each epoch (deterministically from `seed` and the epoch)."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    drop_last: bool = True
    """Drop the last incomplete batch of each epoch."""

    def __post_init__(self):
        if isinstance(self.files, str):
            self.files = [self.files]
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"DataConfig.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        if self.max_prompt_tokens <= 0:
            raise ValueError(f"DataConfig.max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"DataConfig.max_samples must be > 0 or None, got {self.max_samples}")


# ---------------------------------------------------------------- reading and writing files


def load_rows(path: str, split: str = "train") -> tuple[list[dict], list[str]]:
    """Rows (dicts) and column names of a parquet / jsonl / json file or an HF saved dataset dir."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"DataConfig.files: {path!r} does not exist (cwd {os.getcwd()})")
    if os.path.isdir(path):
        return _load_hf_dir(path, split)
    ext = os.path.splitext(path)[1].lower()
    loaders = {".parquet": _load_parquet, ".jsonl": _load_jsonl, ".json": _load_json}
    if ext not in loaders:
        raise ValueError(f"{path}: unsupported file type {ext!r}; use one of {sorted(loaders)} or an HF dataset dir")
    return loaders[ext](path)


def _load_parquet(path: str) -> tuple[list[dict], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as parquet:  # one file: not `read_table`, whose dataset layer imports pandas (0.4 s)
            table = parquet.read()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"{path}: not a readable parquet file ({e}); rewrite it, or give it the extension of"
            " its real format (.jsonl / .json)"
        ) from e
    return table.to_pylist(), table.column_names


def _load_jsonl(path: str) -> tuple[list[dict], list[str]]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, f"{path} line {lineno}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({e})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows, list(rows[0]) if rows else []


def _load_json(path: str) -> tuple[list[dict], list[str]]:
    with open(path, "rb") as f:
        text = _utf8(f.read(), path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise ValueError(f"{path}: columnar JSON needs equal-length lists, got lengths {sorted(lengths)}")
        data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: JSON must be a list of row objects or an object of equal-length column lists")
    return data, list(data[0]) if data else []


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start} of that"
            f" {'line' if 'line' in where else 'file'}); re-encode the file as UTF-8"
        ) from None


def _load_hf_dir(path: str, split: str) -> tuple[list[dict], list[str]]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise ValueError(f"{path}: a directory must be written by `datasets.save_to_disk` ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (DataConfig.split); splits present: {sorted(ds)}")
        ds = ds[split]
    return ds.to_list(), list(ds.column_names)


def save_rows(rows: Sequence[dict], path: str) -> None:
    """Write rows as parquet (or jsonl when `path` ends in .jsonl), creating parent dirs."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path)


# ---------------------------------------------------------------- validation


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _check_columns(path: str, columns: list[str], config: DataConfig) -> None:
    keys = {"prompt_key": config.prompt_key, "ground_truth_key": config.ground_truth_key}
    for field_name, key in keys.items():
        if key is not None and key.split(".")[0] not in columns:
            raise ValueError(
                f"{path}: column {key.split('.')[0]!r} (DataConfig.{field_name}={key!r}) not found; "
                f"columns present: {columns}. Set DataConfig.{field_name} to the right column."
            )
    clash = sorted(set(columns) & set(PRODUCED_COLUMNS) - set(keys.values()) - {config.data_source_key})
    if clash:
        raise ValueError(f"{path}: columns {clash} clash with names PromptDataset produces; rename them")


def _check_prompt(prompt: Any, where: str, config: DataConfig) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        if not config.apply_chat_template:
            raise ValueError(
                f"{where}: prompt is a list of chat messages but DataConfig.apply_chat_template is false; "
                "set it to true or store raw strings"
            )
        return
    raise ValueError(
        f"{where}: {config.prompt_key!r} must be a string or a non-empty list of "
        f"{{'role': str, 'content': str}} messages, got {_describe(prompt)}"
    )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _ground_truth_str(value: Any) -> str:
    """Ground truth as the string reward fns take (numbers -> str, structures -> JSON)."""
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


# ---------------------------------------------------------------- the dataset


def truncate(ids: list[int], limit: int, mode: str, where: str = "prompt") -> list[int]:
    """`ids` cut to `limit` tokens: `left` keeps the end, `right` the start, `middle` both ends."""
    if len(ids) <= limit:
        return ids
    if mode == "left":
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    if mode == "middle":
        head = (limit + 1) // 2
        return ids[:head] + ids[len(ids) - (limit - head) :]
    raise ValueError(
        f"{where}: prompt has {len(ids)} tokens > DataConfig.max_prompt_tokens={limit}; raise the limit, "
        "set DataConfig.truncation to left|right|middle, or set DataConfig.filter_overlong=true"
    )


class PromptDataset(torch.utils.data.Dataset):
    """Validated, tokenised prompts; item i is `{"input_ids": np.int64 array, raw_prompt, ground_truth,
    data_source, dataset_index, <other columns>}`."""

    def __init__(self, config: DataConfig, tokenizer, files: Sequence[str] | None = None):
        self.config, self.tokenizer = config, tokenizer
        files = list(files if files is not None else config.files)
        if not files:
            raise ValueError("DataConfig.files is empty; give at least one prompt file")
        if config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set DataConfig.apply_chat_template=false")
        rows, where = self._read(files)
        self.input_ids, self.rows = self._tokenize(rows, where)
        if config.max_samples is not None:
            self.input_ids, self.rows = self.input_ids[: config.max_samples], self.rows[: config.max_samples]
        for i, row in enumerate(self.rows):
            row["dataset_index"] = i

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[i], **self.rows[i]}

    def _read(self, files: list[str]) -> tuple[list[dict], list[str]]:
        """All rows of all files as {raw_prompt, ground_truth, data_source, extras}, plus their locations."""
        rows, where = [], []
        for path in files:
            file_rows, columns = load_rows(path, self.config.split)
            _check_columns(path, columns, self.config)
            for r, row in enumerate(file_rows):
                rows.append(self._parse_row(row, f"{path} row {r}"))
                where.append(f"{path} row {r}")
        return rows, where

    def _parse_row(self, row: dict, where: str) -> dict[str, Any]:
        cfg = self.config
        if cfg.prompt_key not in row:
            raise ValueError(f"{where}: missing {cfg.prompt_key!r} (DataConfig.prompt_key)")
        _check_prompt(row[cfg.prompt_key], where, cfg)
        out = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.ground_truth_key, cfg.data_source_key)}
        out["raw_prompt"] = row[cfg.prompt_key]
        out["data_source"] = row.get(cfg.data_source_key) or cfg.default_data_source
        if cfg.ground_truth_key is not None:
            try:
                out["ground_truth"] = _ground_truth_str(_get(row, cfg.ground_truth_key))
            except KeyError:
                raise ValueError(f"{where}: missing {cfg.ground_truth_key!r} (DataConfig.ground_truth_key)") from None
        return out

    def render(self, prompt: str | list[dict]) -> str:
        """The prompt text the model sees (chat template + generation prompt, or the raw string)."""
        if not self.config.apply_chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _tokenize(self, rows: list[dict], where: list[str]) -> tuple[list[np.ndarray], list[dict]]:
        cfg = self.config
        texts = [self.render(row["raw_prompt"]) for row in rows]
        encoded = self.tokenizer(texts, add_special_tokens=not cfg.apply_chat_template)["input_ids"] if texts else []
        kept_ids, kept_rows, overlong = [], [], 0
        for ids, row, loc in zip(encoded, rows, where):
            if len(ids) > cfg.max_prompt_tokens and cfg.filter_overlong:
                overlong += 1
                continue
            kept_ids.append(np.asarray(truncate(ids, cfg.max_prompt_tokens, cfg.truncation, loc), dtype=np.int64))
            kept_rows.append(row)
        self.num_filtered = overlong
        if overlong:
            logger.info(
                "filtered %d of %d prompts longer than max_prompt_tokens=%d", overlong, len(rows), cfg.max_prompt_tokens
            )
        return kept_ids, kept_rows


# ---------------------------------------------------------------- batches


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int, meta: dict[str, Any] | None = None) -> Batch:
    """The prompts as a rollout `Batch`: `input_ids` left-padded to the longest prompt (with
    `attention_mask`, `position_ids` [B, L]); every other field an object column (the schema's
    dataset columns, plus the file's pass-through columns)."""
    length = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    for b, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[b, length - n :] = torch.as_tensor(item["input_ids"], dtype=torch.long)
        attention_mask[b, length - n :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    columns = _object_columns(items)
    return Batch(tensors, columns, meta, schema=ROLLOUT.with_data_columns(columns))


def _object_columns(items: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    keys = [k for k in items[0] if k != "input_ids"]
    columns = {}
    for key in keys:
        column = np.empty(len(items), dtype=object)  # filled one by one: lists must stay objects
        for b, item in enumerate(items):
            column[b] = item.get(key)
        columns[key] = column
    return columns


class PromptLoader:
    """Batches of `prompts_per_step` prompts, epoch after epoch, resumable at the exact next prompt.

    The order of epoch e is a permutation drawn from (seed, e) alone, so a loader restored from
    `state_dict()` (epoch, position) yields what the uninterrupted one would have.
    """

    def __init__(
        self, dataset: PromptDataset, prompts_per_step: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True
    ):
        if prompts_per_step <= 0:
            raise ValueError(f"prompts_per_step must be > 0, got {prompts_per_step}")
        if len(dataset) == 0 or (drop_last and len(dataset) < prompts_per_step):
            raise ValueError(
                f"the dataset has {len(dataset)} prompts (after filtering), fewer than prompts_per_step="
                f"{prompts_per_step}; lower prompts_per_step or add data"
            )
        self.dataset, self.prompts_per_step = dataset, prompts_per_step
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def from_config(cls, dataset: PromptDataset, config: DataConfig, prompts_per_step: int) -> "PromptLoader":
        """A loader with the shuffle, seed and drop_last of `config`."""
        return cls(dataset, prompts_per_step, seed=config.seed, shuffle=config.shuffle, drop_last=config.drop_last)

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.dataset), self.prompts_per_step
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.dataset)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _epoch_exhausted(self) -> bool:
        left = len(self.dataset) - self.position
        return left < self.prompts_per_step if self.drop_last else left <= 0

    def next_batch(self) -> Batch:
        """The next batch, moving on to the next epoch when this one cannot fill a batch."""
        if self._epoch_exhausted():
            self.epoch, self.position = self.epoch + 1, 0
        indices = self.order(self.epoch)[self.position : self.position + self.prompts_per_step]
        self.position += len(indices)
        items = [self.dataset[int(i)] for i in indices]
        return collate_prompts(items, self.dataset.tokenizer.pad_token_id)

    def __iter__(self):
        """The remaining batches of the current epoch (of the next one, if this one is used up)."""
        yield self.next_batch()
        while not self._epoch_exhausted():
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        """Where the loader stands: the next batch starts at `position` of epoch `epoch`."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continue exactly where the saved loader stood; fails if the data or the order changed."""
        mine = self.state_dict()
        for key in ("num_prompts", "seed", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"PromptLoader.load_state_dict: saved {key}={state[key]!r} but this loader has "
                    f"{mine[key]!r}; resume with the same data, filtering and DataConfig.seed/shuffle"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
