"""Streaming reads and writes of HuggingFace safetensors checkpoints.

Owns: `HFCheckpointReader` (lazy, one tensor at a time, with clear errors for missing or corrupt
files and missing tensors), `HFShardWriter` (bounded-size safetensors shards + index) and
`write_safetensors` (one safetensors file, written behind: `megarl.utils.write_behind`).
Must not import megatron, vLLM or Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, Optional

import torch

from megarl.utils.write_behind import WriteBehindFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
"""Everything of an HF checkpoint but its weights: config, generation config, tokenizer files."""


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, incomplete or corrupt."""


class HFCheckpointReader:
    """Reads tensors of an HF checkpoint directory lazily (safetensors, single file or sharded)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {self.path} does not exist")
        self._open: dict[str, object] = {}
        self._where = self._index()

    def _index(self) -> dict[str, str]:
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index} is corrupt ({err!r}); re-download or re-export it") from err
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} lists shard files that are missing: {missing}")
            return weight_map
        if single.is_file():
            return {name: SINGLE_FILE for name in self._file(SINGLE_FILE).keys()}
        found = sorted(p.name for p in self.path.iterdir())
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path} (found {found}); only safetensors checkpoints"
            " are read — convert .bin weights with transformers' save_pretrained(safe_serialization=True)"
        )

    def _file(self, filename: str):
        from safetensors import safe_open

        if filename not in self._open:
            try:
                self._open[filename] = safe_open(str(self.path / filename), framework="pt")
            except Exception as err:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{self.path / filename} is not a readable safetensors file: {err}") from err
        return self._open[filename]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        with self._reading(name) as file:
            return file.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name` (from the file's header; nothing is read)."""
        with self._reading(name) as file:
            return tuple(file.get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, dim: int = 0) -> torch.Tensor:
        """Elements [start, stop) of tensor `name` along `dim` (0 or 1), reading only those bytes."""
        with self._reading(name) as file:
            piece = file.get_slice(name)
            return piece[start:stop] if dim == 0 else piece[:, start:stop]

    @contextlib.contextmanager
    def _reading(self, name: str):
        """The open file holding tensor `name`; a missing tensor or a failed read is a CheckpointError naming it."""
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} is missing from the HF checkpoint {self.path}")
        try:
            yield self._file(self._where[name])
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read {name!r} from {self.path / self._where[name]}: {err}") from err

    def check_has(self, names: Iterable[str]) -> None:
        """Raise one error listing every expected tensor that is absent (before any is read)."""
        missing = [n for n in names if n not in self._where]
        if missing:
            raise CheckpointError(
                f"HF checkpoint {self.path} lacks {len(missing)} expected tensors, e.g. {missing[:5]};"
                " does config.json match the weights?"
            )


class HFShardWriter:
    """Writes (name, tensor) pairs into safetensors shards of at most `max_shard_bytes` each."""

    def __init__(self, path: str | Path, prefix: str = "model", max_shard_bytes: int = 2 << 30):
        self.path, self.prefix, self.max_shard_bytes = Path(path), prefix, max_shard_bytes
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._pending: dict[str, torch.Tensor] = {}
        self.dtypes: set[torch.dtype] = set()
        self._pending_bytes = 0
        self._files = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self.dtypes.add(tensor.dtype)
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        self._files += 1
        filename = f"{self.prefix}-{self._files:05d}.safetensors"
        write_safetensors(self.path / filename, self._pending, metadata={"format": "pt"})
        self.weight_map.update({name: filename for name in self._pending})
        self._pending, self._pending_bytes = {}, 0


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> None:
    """`tensors` (contiguous CPU tensors) as one durable safetensors file at `path`, written behind
    (`WriteBehindFile`: synced and dropped from the page cache every 16 MiB) instead of through
    `safetensors.torch.save_file`, which fills the page cache with the whole file: 404 MiB of fp32
    tensors took 0.22–0.43 s against 0.72–1.00 s here, each into a new file. The same format: an 8-byte little-endian header
    length, the JSON header padded with spaces to 8 bytes, then each tensor's bytes, largest elements
    first (every tensor aligned to its element size). A dtype outside `_SAFETENSORS_DTYPES` goes
    through safetensors itself (then synced)."""
    if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata=metadata)
        with open(path, "rb+") as written:
            os.fsync(written.fileno())
        return
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with WriteBehindFile(path) as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for name in order:
            if tensors[name].numel():
                stream.write(tensors[name].detach().reshape(-1).view(torch.uint8).numpy())
        stream.sync()


def write_index(path: str | Path, weight_map: dict[str, str], total_bytes: int) -> None:
    """The `model.safetensors.index.json` that `transformers` uses to find sharded tensors."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(path) / INDEX_FILE).write_text(json.dumps(index, indent=2))


def record_dtype(path: str | Path, dtypes) -> None:
    """Set `path/config.json`'s `dtype` to the one floating dtype its weights were written in (`dtypes`), where
    it names another: transformers and vLLM load `dtype="auto"` from it, and a bfloat16 export whose config
    said float32 (its source's, before `--dtype bfloat16`) loaded at twice the memory."""
    floating = {d for d in dtypes if d.is_floating_point}
    config_file = Path(path) / "config.json"
    if len(floating) != 1 or not config_file.is_file():
        return
    name = str(floating.pop()).replace("torch.", "")
    config = json.loads(config_file.read_text())
    if config.get("dtype") == name and config.get("torch_dtype", name) == name:
        return
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy the config and tokenizer files (`HF_SIDE_FILES`) that exist in `src` into `dst`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
