"""Weight tables and split/merge rules (pure torch, no megatron)."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.hf_config import describe_hf_config, load_hf_config
from megarl.models.mapping import GateUpMapping, QKVMapping, VocabMapping, padded_vocab_size
from megarl.models.weight_map import WeightMap


def _dims(path):
    return describe_hf_config(load_hf_config(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_weight_map_covers_exactly_the_hf_tensors(tiny_models, arch):
    hf_names = set(load_file(tiny_models[arch] / "model.safetensors"))
    assert set(WeightMap(_dims(tiny_models[arch])).hf_names()) == hf_names


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_by_query_group_roundtrip_and_tp_shards_hold_whole_groups(tiny_models, tp):
    dims = _dims(tiny_models["qwen3"])  # head_dim 32 != hidden / heads
    q = torch.randn(dims.num_heads * dims.head_dim, dims.hidden_size)
    k, v = (torch.randn(dims.num_kv_heads * dims.head_dim, dims.hidden_size) for _ in range(2))
    mapping = QKVMapping("qkv", ("q", "k", "v"))
    full = mapping.to_mcore([q, k, v], dims, 0)
    per_group = (dims.num_heads // dims.num_kv_heads + 2) * dims.head_dim
    # group 0 starts with query head 0, then its key head, then its value head
    assert torch.equal(full[: dims.head_dim], q[: dims.head_dim])
    assert torch.equal(full[per_group - 2 * dims.head_dim : per_group - dims.head_dim], k[: dims.head_dim])
    shards = [mapping.shard(full, r, tp) for r in range(tp)]
    assert all(s.shape[0] == dims.num_kv_heads // tp * per_group for s in shards)
    back = mapping.to_hf(mapping.unshard(shards), dims)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_qkv_bias_roundtrip(tiny_models):
    dims = _dims(tiny_models["qwen2"])
    q, k, v = torch.randn(64), torch.randn(32), torch.randn(32)
    mapping = QKVMapping("qkv_bias", ("q", "k", "v"))
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(mapping.to_mcore([q, k, v], dims, 0), dims), [q, k, v]))


def test_gate_up_shards_are_gate_then_up_per_rank():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    mapping = GateUpMapping("fc1", ("gate", "up"))
    full = mapping.to_mcore([gate, up], None, 0)
    shard1 = mapping.shard(full, 1, 2)
    assert torch.equal(shard1, torch.cat([gate[2:], up[2:]]))
    assert torch.equal(mapping.unshard([mapping.shard(full, r, 2) for r in range(2)]), full)


def test_vocab_padding_to_multiple_of_tp_times_128_and_dropped_on_export(tiny_models):
    dims = _dims(tiny_models["llama"])
    assert padded_vocab_size(96, 1) == 128 and padded_vocab_size(96, 2) == 256 and padded_vocab_size(300, 2) == 512
    weight = torch.randn(96, 64)
    mapping = VocabMapping("emb", ("e",))
    full = mapping.to_mcore([weight], dims, 256)
    assert full.shape == (256, 64) and torch.count_nonzero(full[96:]) == 0
    assert torch.equal(mapping.to_hf(full, dims)[0], weight)


def test_lookup_offsets_layers_and_accepts_te_and_ddp_names(tiny_models):
    wmap = WeightMap(_dims(tiny_models["llama"]))
    assert wmap.lookup("decoder.layers.0.mlp.linear_fc2.weight", layer_offset=1).hf == (
        "model.layers.1.mlp.down_proj.weight",
    )
    te = wmap.lookup("module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
    assert te.hf == ("model.layers.1.input_layernorm.weight",)
    with pytest.raises(KeyError, match="no HF mapping for megatron parameter"):
        wmap.lookup("decoder.layers.0.mlp.router.weight")


def test_tied_embeddings_load_output_copy_from_embedding_and_never_export_it(tiny_models):
    wmap = WeightMap(_dims(tiny_models["qwen2"]))  # tied
    assert wmap.lookup("output_layer.weight").hf == ("model.embed_tokens.weight",)
    assert wmap.is_tied_copy("output_layer.weight") and "lm_head.weight" not in wmap.hf_names()


def test_value_head_maps_to_score(tiny_models):
    wmap = WeightMap(_dims(tiny_models["qwen2"]), value_head=True)
    assert wmap.lookup("output_layer.weight").hf == ("score.weight",)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_tensor_is_the_shards_in_order_only_where_the_mapping_says_so(tiny_models, arch):
    """`hf_is_shards_in_order`: the HF tensor is the first elements of the TP shards laid end to end
    (the sharding manager then loads the received buffer as it is); every other mapping says False."""
    dims = _dims(tiny_models[arch])
    padded = padded_vocab_size(dims.vocab_size, 2)
    in_order = set()
    for mapping in WeightMap(dims).all_mappings():
        if mapping.tp_dim is None:
            continue
        vocab = isinstance(mapping, VocabMapping)
        hf = [torch.randn(dims.vocab_size if vocab else 8 * dims.hidden_size, dims.hidden_size) for _ in mapping.hf]
        if isinstance(mapping, QKVMapping):
            hf = [torch.randn(n * dims.head_dim, dims.hidden_size) for n in (dims.num_heads, *[dims.num_kv_heads] * 2)]
            hf = [t[:, 0] for t in hf] if mapping.mcore.endswith("bias") else hf
        shards = [mapping.shard(mapping.to_mcore(hf, dims, padded), r, 2) for r in range(2)]
        laid = torch.cat([s.reshape(-1) for s in shards])
        exported = torch.cat([t.reshape(-1) for t in mapping.to_hf(mapping.unshard(shards), dims)])
        assert mapping.hf_is_shards_in_order == torch.equal(laid[: exported.numel()], exported), mapping.mcore
        if mapping.hf_is_shards_in_order:
            in_order.add(mapping.mcore.split(".")[0])
    assert "embedding" in in_order and in_order <= {"embedding", "output_layer"}


class _CountingReader:
    """An HFCheckpointReader that counts the elements it hands out."""

    def __init__(self, path):
        from megarl.models.hf_io import HFCheckpointReader

        self.reader, self.elements = HFCheckpointReader(path), 0

    def shape(self, name):
        return self.reader.shape(name)

    def get(self, name):
        return self._count(self.reader.get(name))

    def rows(self, name, start, stop, dim=0):
        return self._count(self.reader.rows(name, start, stop, dim))

    def _count(self, tensor):
        self.elements += tensor.numel()
        return tensor


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_load_shard_reads_only_the_ranks_rows_and_equals_shard_of_the_full_tensor(tiny_models, arch, tp):
    dims = _dims(tiny_models[arch])
    padded = padded_vocab_size(dims.vocab_size, tp)
    full_reader = _CountingReader(tiny_models[arch])
    for mapping in WeightMap(dims).all_mappings():
        full = mapping.to_mcore([full_reader.get(n) for n in mapping.hf], dims, padded)
        for rank in range(tp):
            expected = mapping.shard(full, rank, tp)
            out = torch.full_like(expected, float("nan"))  # an element left unwritten stays NaN
            reader = _CountingReader(tiny_models[arch])
            mapping.load_shard(reader, dims, padded, rank, tp, out)
            assert torch.equal(out, expected), (mapping.mcore, rank)
            real_rows = isinstance(mapping, VocabMapping)  # padding rows are zeroed, not read
            assert reader.elements <= out.numel() if real_rows else reader.elements == out.numel(), mapping.mcore


def test_load_shard_names_the_tensor_that_does_not_fit(tiny_models):
    dims = _dims(tiny_models["llama"])
    mapping = next(m for m in WeightMap(dims).all_mappings() if isinstance(m, GateUpMapping))
    reader = _CountingReader(tiny_models["llama"])
    out = torch.empty(2 * (dims.ffn_hidden_size + 8), dims.hidden_size)  # a config with a larger intermediate_size
    with pytest.raises(ValueError, match=r"gate_proj.*does not fit the model's.*does config.json match the weights"):
        mapping.load_shard(reader, dims, 0, 0, 1, out)
