"""megarl's safetensors writer: files safetensors itself reads back bit for bit, written behind."""

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megarl.models.hf_io import HFShardWriter, write_safetensors
from megarl.utils import write_behind


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(6, 5, generator=gen)
    return {
        "model.embed_tokens.weight": torch.randn(37, 8, generator=gen),
        "lm_head.weight": torch.randn(37, 8, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(3, generator=gen).to(torch.float16),
        "a.row_of_a_larger_tensor": whole[2],  # a view with a storage offset: only its own bytes
        "position_ids": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "fp8": torch.randn(5, generator=gen).to(torch.float8_e4m3fn),
    }


def test_write_safetensors_is_read_back_bit_for_bit_by_safetensors(tmp_path, monkeypatch):
    monkeypatch.setattr(write_behind, "WRITE_BEHIND_BYTES", 64)  # synced and dropped many times per file
    tensors = _tensors()
    write_safetensors(tmp_path / "mine.safetensors", tensors, metadata={"format": "pt"})
    with safe_open(str(tmp_path / "mine.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(_bytes(got), _bytes(tensor)), name
    # the same tensors through safetensors' own writer: the same header entries, the same bytes per tensor
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    mine, theirs = _header(tmp_path / "mine.safetensors"), _header(tmp_path / "theirs.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in mine.items() if k != "__metadata__"} == {
        k: (v["dtype"], v["shape"]) for k, v in theirs.items() if k != "__metadata__"
    }


def _header(path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0 and 8 + length <= len(raw)
    header = json.loads(raw[8 : 8 + length])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    # the data is tiled by the tensors, each aligned to its element size
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "BOOL": 1}
    assert all(v["data_offsets"][0] % sizes[v["dtype"]] == 0 for k, v in header.items() if k != "__metadata__")
    return header


def test_a_dtype_megarl_does_not_name_is_written_by_safetensors(tmp_path):
    tensors = {"c": torch.randn(4, dtype=torch.complex64), "w": torch.randn(3)}
    write_safetensors(tmp_path / "c.safetensors", tensors)
    got = load_file(tmp_path / "c.safetensors")
    assert torch.equal(got["c"], tensors["c"]) and torch.equal(got["w"], tensors["w"])


def test_shard_writer_splits_at_its_limit_and_maps_every_tensor(tmp_path):
    tensors = _tensors()
    writer = HFShardWriter(tmp_path, max_shard_bytes=300)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.flush()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and set(writer.weight_map.values()) == set(files)
    for name, tensor in tensors.items():
        got = load_file(tmp_path / writer.weight_map[name])[name]
        assert torch.equal(_bytes(got), _bytes(tensor)), name
