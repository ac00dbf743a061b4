"""`mcore-to-hf` of a dense model in one process, without megatron-core: the torch_dist checkpoint read
through torch's distributed-checkpoint metadata and mapped by `megarl.models.weight_map`.

Owns: `applies(plan)` (a single-rank export of a dense model, outside torchrun, from a checkpoint in
the plain `torch_save` storage format), `hf_weights(path, weight_map)`, the checkpoint's (HF name,
tensor) stream, and what the conversion's checks read from the DCP metadata (`stored_dtype`,
`has_value_head`). `convert.mcore_to_hf` writes and publishes that stream where it applies; MoE checkpoints
(expert axes), other layouts and torchrun keep the megatron path.

Why: the megatron path builds a megatron model on a forked rank and loads the whole checkpoint into
it before the first tensor is written; here nothing but the tensors being written is in memory (one
layer's, plus the HF shard being filled, ≤ 2 GiB), no rank or megatron-core import is needed, and the
disk reads the next layer ahead. A torch_dist checkpoint is a torch DCP checkpoint: `.metadata` gives
every tensor's global size and its chunks, each chunk one `torch.save` record at (file, offset, length)
in a `__*.distcp` file. The parameters under `decoder.layers.` are stacked over a prepended global
layer axis (PP and VPP stages already renumbered), so layer `i` of a key is its chunks at
`offsets[0] == i`; their TP pieces assemble into the TP1 tensor, which the TP1 `Mapping.to_hf` rules
turn into HF tensors. For benchmarks/convert_throughput.py's 475 MiB model the `megarl convert
mcore-to-hf` command is as fast as the megatron path's within the noise (its imports, torch and
transformers' config classes, are ~2.3 s of its 3-4 s); the read and write take 0.5 s each.
Must not import megatron, vLLM or Ray.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
from pathlib import Path
from typing import Iterator

import torch

from megarl.models.hf_config import describe_hf_config, load_hf_config
from megarl.models.hf_io import CheckpointError
from megarl.models.weight_map import WeightMap, canonical_name

_LAYERS = "decoder.layers."


class _Chunks:
    """The tensor chunks of one DCP checkpoint directory, read one record at a time."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        index = path / ".metadata"
        if not index.is_file():
            raise CheckpointError(f"{path} has no .metadata: it is not a torch_dist checkpoint, or an incomplete copy")
        self.path = path
        try:
            self.metadata = _read_metadata(str(index), index.stat().st_mtime_ns)
        except (EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
            raise CheckpointError(
                f"{index} is unreadable ({err!r}): the checkpoint is damaged; save or convert it again"
            ) from err
        self.tensors = {
            key: meta
            for key, meta in self.metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        self._files: dict[str, io.BufferedReader] = {}

    def plain_storage(self) -> bool:
        """Every record a plain `torch.save` (no compression or other storage transform)."""
        return not any(getattr(info, "transform_descriptors", None) for info in self.metadata.storage_data.values())

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor of `key`, or its slice `[layer]` of the stacked layer axis, assembled from its chunks."""
        meta = self.tensors[key]
        size = list(meta.size) if layer is None else list(meta.size[1:])
        stored = self._stored(key, layer)
        out, covered = None, 0
        for chunk, info in stored:
            piece, offsets, sizes = self._record(key, info), list(chunk.offsets), list(chunk.sizes)
            if layer is not None:
                piece, offsets, sizes = piece[layer - offsets[0]], offsets[1:], sizes[1:]
            if sizes == size and len(stored) == 1:
                return piece  # one chunk holds it all: no copy
            if out is None:
                out = torch.empty(size, dtype=meta.properties.dtype)
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
            covered += piece.numel()
        if out is None or covered != out.numel():
            raise CheckpointError(
                f"{self.path}: the stored chunks of {key!r}"
                + (f" (layer {layer})" if layer is not None else "")
                + f" cover {covered} of its {math.prod(size)} elements: the checkpoint's .metadata is damaged"
            )
        return out

    def prefetch(self, keys, layer: int | None = None) -> None:
        """Ask the kernel to read ahead the records of `keys` (at `layer`), so that the disk reads them while
        the layer before is mapped and written: a checkpoint just written behind (`dcp_save`) is no longer in
        the page cache; reading benchmarks/convert_throughput.py's model from the disk took 0.36-0.79 s
        (median 0.64) one record after another against 0.47-0.73 s (median 0.49) one layer ahead, 5 rounds
        each (0.30-0.42 s from the page cache)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for key in keys:
            for _, info in self._stored(key, layer):
                os.posix_fadvise(self._file(info).fileno(), info.offset, info.length, os.POSIX_FADV_WILLNEED)

    def _stored(self, key: str, layer: int | None) -> list:
        """(chunk, storage info) of each stored chunk of `key` (of those holding `layer`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        chunks = self.tensors[key].chunks
        if layer is not None:
            chunks = [c for c in chunks if c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]]
        return [(c, self.metadata.storage_data[MetadataIndex(key, c.offsets)]) for c in chunks]

    def _file(self, info) -> io.BufferedReader:
        stream = self._files.get(info.relative_path)
        if stream is None:
            path = self.path / info.relative_path
            if not path.is_file():
                raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; save or convert it again")
            stream = self._files[info.relative_path] = open(path, "rb")
        return stream

    def _record(self, key: str, info) -> torch.Tensor:
        # torch.load reads the record in place: through a BytesIO of its bytes, the 475 MiB of
        # benchmarks/convert_throughput.py's model took 0.49-0.58 s to load against 0.14-0.15 s
        view = _FileView(self._file(info), info.offset, info.length)
        try:
            return torch.load(view, map_location="cpu", weights_only=True)
        except Exception as err:
            if view.interrupted is not None:  # Ctrl-C inside torch's C++ reader came back as another error
                raise view.interrupted from None
            if not isinstance(err, (RuntimeError, EOFError, ValueError)):
                raise
            raise CheckpointError(
                f"{self.path / info.relative_path}: the record of {key!r} is unreadable ({err}); the checkpoint"
                " is damaged (a torn write or a truncated copy): save or convert it again"
            ) from err

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()
        self._files.clear()


@functools.lru_cache(maxsize=4)
def _read_metadata(index: str, mtime_ns: int):
    """A checkpoint's DCP metadata, read once per version of its `.metadata` (a conversion's checks and
    its export read it four times; a large layout's file holds an entry per chunk)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(Path(index).parent)).read_metadata()


class _FileView(io.RawIOBase):
    """Bytes [offset, offset + length) of an open binary file, as a seekable file of their own."""

    def __init__(self, stream, offset: int, length: int):
        super().__init__()
        self._stream, self._start, self._end = stream, offset, offset + length
        self.interrupted: BaseException | None = None
        """A KeyboardInterrupt (or SystemExit) raised in `readinto`: torch's zip reader, which calls it from
        C++, reports it as `AttributeError: ... no attribute 'read'` (seen on Ctrl-C during an export)."""
        stream.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._stream.tell() - self._start

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._stream.tell(), io.SEEK_END: self._end}[whence]
        return self._stream.seek(min(max(base + offset, self._start), self._end)) - self._start

    def readinto(self, buffer) -> int:
        try:
            view = memoryview(buffer)[: max(0, self._end - self._stream.tell())]
            return self._stream.readinto(view)
        except (KeyboardInterrupt, SystemExit) as stop:
            self.interrupted = stop
            raise


def applies(plan) -> bool:
    """Whether `convert.export_in_process` can run `plan` (a `convert.ConversionPlan` of mcore→hf)."""
    from megarl.utils import distributed

    if plan.world_size != 1 or distributed.in_launched_world():
        return False
    if describe_hf_config(load_hf_config(Path(plan.src) / "hf")).moe:
        return False
    return _Chunks(Path(plan.src)).plain_storage()


def stored_dtype(path) -> str:
    """The dtype name ("float32", "bfloat16", ...) the checkpoint at `path` stores its word embeddings in
    (a trainer's checkpoint records no dtype in its marker: its parameters are in the training dtype)."""
    meta = _Chunks(Path(path)).tensors.get("embedding.word_embeddings.weight")
    if meta is None:
        raise CheckpointError(f"{path} holds no embedding.word_embeddings.weight: it is not a GPT model checkpoint")
    return str(meta.properties.dtype).replace("torch.", "")


def has_value_head(path) -> bool:
    """Whether the checkpoint at `path` is a value model's (a critic or reward model): an output layer of one row."""
    meta = _Chunks(Path(path)).tensors.get("output_layer.weight")
    return meta is not None and meta.size[0] == 1


def hf_weights(path: Path, weight_map: WeightMap) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every model parameter in the checkpoint at `path`, layer by layer in HF order."""
    chunks = _Chunks(Path(path))
    try:
        yield from _hf_weights(chunks, weight_map)
    finally:
        chunks.close()


def _hf_weights(chunks: _Chunks, weight_map: WeightMap) -> Iterator[tuple[str, torch.Tensor]]:
    dims = weight_map.dims
    layered = [k for k in sorted(chunks.tensors) if k.startswith(_LAYERS) and _known(weight_map, _layer_name(k, 0))]
    others = [
        k
        for k in chunks.tensors
        if not k.startswith(_LAYERS) and _known(weight_map, k) and not weight_map.is_tied_copy(k)
    ]
    for key in layered:
        if chunks.tensors[key].size[0] != dims.num_layers:
            raise CheckpointError(
                f"{chunks.path}: {key!r} holds {chunks.tensors[key].size[0]} layers, but its hf/config.json has"
                f" {dims.num_layers}: the config is not the one these weights were written with"
            )
    embedding = [k for k in others if canonical_name(k) == "embedding.word_embeddings.weight"]
    steps = [(embedding, None), *((layered, i) for i in range(dims.num_layers))]
    steps.append(([k for k in others if k not in embedding], None))
    chunks.prefetch(*steps[0])
    for n, (keys, layer) in enumerate(steps):
        if n + 1 < len(steps):
            chunks.prefetch(*steps[n + 1])  # the disk reads the next step while this one is mapped
        for key in keys:
            name = key if layer is None else _layer_name(key, layer)
            yield from _mapped(weight_map, name, chunks.read(key, layer), dims)


def _layer_name(key: str, layer: int) -> str:
    """`decoder.layers.<rest>` (stacked over layers) as layer `layer`'s parameter name."""
    return f"{_LAYERS}{layer}.{key[len(_LAYERS) :]}"


def _known(weight_map: WeightMap, name: str) -> bool:
    try:
        weight_map.lookup(name)
    except KeyError:
        return False  # not a model parameter (a training checkpoint's optimizer state, say)
    return True


def _mapped(weight_map: WeightMap, name: str, full: torch.Tensor, dims) -> Iterator[tuple[str, torch.Tensor]]:
    mapping = weight_map.lookup(name)
    yield from zip(mapping.hf, mapping.to_hf(full, dims))
