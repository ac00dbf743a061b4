"""The sharding planner (pure): buckets respect the bound, every HF tensor appears exactly once."""

import os

import pytest
import torch

from megarl.models.hf_config import describe_hf_config
from megarl.models.mapping import Mapping, padded_vocab_size
from megarl.models.weight_map import WeightMap
from megarl.rollout.sharding.pack import pack_bucket, unpack_bucket, write_shards
from megarl.rollout.sharding.plan import ParamMeta, PlanError, plan_sync
from megarl.testing.models import tiny_hf_config


def fake_training_layout(config, tp, pp, vpp=1, rank=0, value=None):
    """ParamMeta of TP rank `rank` on every stage, and the local shards made from HF tensors `value`."""
    dims = describe_hf_config(config)
    wmap = WeightMap(dims)
    padded = padded_vocab_size(dims.vocab_size, tp)
    per_chunk = dims.num_layers // (pp * vpp)
    metas, local = [], {}
    for mapping in wmap.all_mappings():
        hf = [value[n] if value else torch.empty(_hf_shape(n, dims), device="meta") for n in mapping.hf]
        shard = mapping.shard(mapping.to_mcore(hf, dims, padded), rank, tp)
        name = mapping.mcore
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            chunk = layer // per_chunk
            pp_rank, vp = chunk % pp, chunk // pp
            name = name.replace(f"layers.{layer}.", f"layers.{layer - chunk * per_chunk}.")
        elif name.startswith("embedding"):
            pp_rank, vp = 0, 0
        else:
            pp_rank, vp = pp - 1, vpp - 1
        metas.append(ParamMeta(name, tuple(shard.shape), "float32", pp_rank, vp, (vp * pp + pp_rank) * per_chunk))
        local[(pp_rank, vp, name)] = shard
    if dims.tie_word_embeddings:  # the last stage's copy, which must never be exported
        emb = next(m for m in metas if m.name.startswith("embedding"))
        metas.append(ParamMeta("output_layer.weight", emb.shape, "float32", pp - 1, vpp - 1, 0))
    return wmap, metas, local


def _hf_shape(name, dims):
    return _shapes(dims)[name]


def _shapes(dims):
    """HF tensor shapes of the tiny config (a meta-device `transformers` model; no memory)."""
    if dims not in _CACHE:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_CONFIGS[dims.model_type])
        _CACHE[dims] = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    return _CACHE[dims]


_CACHE = {}
_CONFIGS = {arch: tiny_hf_config(arch, num_layers=4) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp,vpp", [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)])
def test_every_hf_tensor_planned_exactly_once_with_hf_shapes(arch, tp, pp, vpp):
    wmap, metas, _ = fake_training_layout(_CONFIGS[arch], tp, pp, vpp)
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=pp, bucket_bytes=40_000)
    names = [s.name for s in plan.hf_specs()]
    assert sorted(names) == sorted(wmap.hf_names())
    assert len(names) == len(set(names))
    shapes = _shapes(wmap.dims)
    assert {s.name: s.shape for s in plan.hf_specs()} == {n: shapes[n] for n in names}
    assert "lm_head.weight" not in names if _CONFIGS[arch].tie_word_embeddings else "lm_head.weight" in names


@pytest.mark.parametrize("bucket_bytes", [1, 10_000, 100_000, 1 << 30])
def test_buckets_respect_the_size_bound(bucket_bytes):
    wmap, metas, _ = fake_training_layout(_CONFIGS["llama"], 2, 2)
    plan = plan_sync(metas, wmap, tp_size=2, pp_size=2, bucket_bytes=bucket_bytes)
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.params) == 1
        assert len({(p.meta.pp_rank) for p in bucket.params}) == 1
    if bucket_bytes == 1 << 30:  # one bucket per stage and kind (sharded / replicated)
        assert len(plan.buckets) <= 4
    assert sum(b.nbytes for b in plan.buckets) == plan.total_bytes


@pytest.mark.parametrize("pp,bucket_bytes", [(2, 40_000), (2, 1 << 30), (4, 20_000), (1, 40_000)])
def test_transfer_order_small_buckets_first_then_sources_take_turns_by_bytes(pp, bucket_bytes):
    """The rollout rank's consumer takes one bucket while the next one's ranks write it: the small buckets (under
    an eighth of the bound: norms) go first, then each large bucket comes from the stage with the fewest bytes
    planned so far (so large buckets alternate stages wherever the bytes allow, with no small one between), and
    every stage's buckets keep their own order."""
    wmap, metas, _ = fake_training_layout(_CONFIGS["llama"], 2, pp)
    plan = plan_sync(metas, wmap, tp_size=2, pp_size=pp, bucket_bytes=bucket_bytes)
    small = [b.nbytes < bucket_bytes // 8 for b in plan.buckets]
    assert small == sorted(small, reverse=True)  # every small bucket before every large one
    large = [b for b in plan.buckets if b.nbytes >= bucket_bytes // 8]
    planned = dict.fromkeys(range(pp), 0)
    for i, bucket in enumerate(large):
        left = {b.source[0] for b in large[i:]}  # stages with large buckets still to come
        assert planned[bucket.source[0]] == min(planned[s] for s in left)
        planned[bucket.source[0]] += bucket.nbytes
    if pp > 1 and bucket_bytes == 40_000:  # the first two large buckets: two stages' ranks write at once
        assert len(large) > pp and large[0].source != large[1].source
    for stage in range(pp):  # a stage's buckets in HF order within each size class
        for group in ([b for b in plan.buckets if small[b.index] == s] for s in (True, False)):
            firsts = [wmap.hf_names().index(b.hf[0].name) for b in group if b.source[0] == stage]
            assert firsts == sorted(firsts)


@pytest.mark.parametrize(
    "arch,tp,pp,vpp", [("qwen2", 2, 2, 2), ("qwen2", 1, 2, 1), ("llama", 2, 2, 1), ("qwen3", 1, 1, 1)]
)
def test_pack_then_unpack_gives_flat_buckets_of_the_hf_tensors(arch, tp, pp, vpp):
    """The bytes path of the plan, without process groups: pack each TP rank, stack, unpack.

    Every bucket arrives as one flat buffer holding its HF tensors contiguously in plan order, bit
    for bit; a replicated bucket (every bucket at TP1) is the received buffer itself, no copy, and
    so is a sharded bucket of one vocab parameter. A sharded bucket unpacked with one row read from
    that TP rank's parameters (`own`) is the same.
    """
    config = _CONFIGS[arch] if arch != "qwen2" else tiny_hf_config("qwen2", num_layers=4)
    dims = describe_hf_config(config)
    torch.manual_seed(0)
    hf = {
        n: torch.randn(s)
        for n, s in _shapes(dims).items()
        if not (n == "lm_head.weight" and config.tie_word_embeddings)
    }
    layouts = [fake_training_layout(config, tp, pp, vpp, rank=r, value=hf) for r in range(tp)]
    wmap, metas, _ = layouts[0]
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=pp, bucket_bytes=20_000)
    got = {}
    for bucket in plan.buckets:
        packed = []
        for _, _, local in layouts:
            params = {(vp, name): t for (p, vp, name), t in local.items() if p == bucket.pp_rank}
            packed.append(pack_bucket(bucket, params, wmap.dims))
            # the GPU's form (few launches) packs the same bytes, every one of them
            nan = torch.full((bucket.local_numel,), float("nan"))
            assert torch.equal(pack_bucket(bucket, params, wmap.dims, out=nan, batched=True), packed[-1])
        gathered = torch.cat(packed) if bucket.sharded else packed[0]
        flat = unpack_bucket(bucket, gathered, wmap.dims)
        assert flat.buffer.is_contiguous() and flat.buffer.numel() == sum(e.numel for e in flat.entries)
        assert [e.offset for e in flat.entries] == [
            sum(e.numel for e in flat.entries[:i]) for i in range(len(flat.entries))
        ]
        if bucket.arrives_flat:  # replicated, or one embedding / output layer: its shards in order
            assert flat.buffer.data_ptr() == gathered.data_ptr()  # travels as received
        for row, (_, _, local) in enumerate(layouts if not bucket.arrives_flat else []):
            # a rollout rank that is TP rank `row` of the stage reads its shards from its parameters
            unpacked = gathered.view(tp, -1).clone()
            unpacked[row] = float("nan")  # never packed
            params = {(vp, name): t for (p, vp, name), t in local.items() if p == bucket.pp_rank}
            own = unpack_bucket(bucket, unpacked.view(-1), wmap.dims, own=(row, params))
            assert torch.equal(own.buffer, flat.buffer)
        if bucket.shards_write_flat:  # same host: every TP rank writes its shards into the flat bucket itself
            direct = torch.full((bucket.gathered_numel,), float("nan"))
            for row, (_, _, local) in enumerate(layouts):
                params = {(vp, name): t for (p, vp, name), t in local.items() if p == bucket.pp_rank}
                write_shards(bucket, params, wmap.dims, row, direct)
            assert torch.equal(direct[: bucket.hf_numel], flat.buffer)  # every element written, bit for bit
        for entry, (name, tensor) in zip(flat.entries, flat.tensors()):
            assert tensor.data_ptr() == flat.buffer.data_ptr() + entry.offset * tensor.element_size()  # views
            got[name] = tensor.clone()
    assert any(b.sharded for b in plan.buckets) == (tp > 1)
    # the embedding (> 20 kB) is alone in its bucket: at TP2 it arrives flat, shards in order
    assert any(b.sharded and b.arrives_flat for b in plan.buckets) == (tp > 1)
    assert all(b.shards_write_flat for b in plan.buckets if b.sharded)  # every kind of this table writes shards
    assert got.keys() == hf.keys()
    for name in hf:
        assert torch.equal(got[name], hf[name]), name


@pytest.mark.parametrize("tp", [1, 2])
def test_a_parameter_of_another_shape_than_planned_fails_the_pack_either_way(tp):
    """The batched pack sizes nothing from the parameter itself: one with a row more than its metadata said is
    refused as the per-tensor pack refuses it, not copied over its neighbour's place."""
    wmap, metas, local = fake_training_layout(_CONFIGS["llama"], tp, 1, value=None)
    local = {key: torch.randn(t.shape) for key, t in local.items()}
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=1, bucket_bytes=20_000)
    bucket = next(b for b in plan.buckets if len(b.params) > 1)
    params = {(vp, name): t for (_, vp, name), t in local.items()}
    first = bucket.params[0].meta
    params[(first.vp_stage, first.name)] = torch.randn(first.shape[0] + 1, *first.shape[1:])
    for batched in (False, True):
        with pytest.raises((RuntimeError, ValueError)):
            pack_bucket(bucket, params, wmap.dims, batched=batched)


def test_a_failing_one_launch_kernel_leaves_the_few_launch_pack(monkeypatch, caplog):
    """A one-launch pack whose Triton kernel fails to build or run (a GPU Triton does not support) is logged once
    and not tried again: every bucket is packed the other way, the same bytes, without sums; the checksums'
    kernel is still tried."""
    from megarl.rollout.sharding import devicesum, pack

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # `available` then accepts CPU tensors
    monkeypatch.setattr(devicesum, "_FAILED", {})
    calls = []

    def failing(*args):
        calls.append(1)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_61")

    monkeypatch.setattr(devicesum, "copy_sums", failing)
    wmap, metas, local = fake_training_layout(_CONFIGS["llama"], 1, 1, value=None)
    params = {(vp, name): torch.randn(t.shape) for (_, vp, name), t in local.items()}
    plan = plan_sync(metas, wmap, tp_size=1, pp_size=1, bucket_bytes=20_000)
    assert devicesum.available(torch.device("cpu"), "piece_copy_sums")
    with caplog.at_level("WARNING", logger=devicesum.__name__):
        for bucket in plan.buckets:
            buf, sums = pack.pack_bucket_summed(bucket, params, wmap.dims, batched=True)
            assert sums is None and torch.equal(buf, pack.pack_bucket(bucket, params, wmap.dims, batched=False))
    assert len(calls) == 1 and "sm_61" in caplog.text and len(plan.buckets) > 1
    assert not devicesum.available(torch.device("cpu"), "piece_copy_sums")
    assert devicesum.available(torch.device("cpu"))  # the checksums' kernel


def test_missing_stage_metadata_is_a_clear_error():
    wmap, metas, _ = fake_training_layout(_CONFIGS["llama"], 1, 2)
    with pytest.raises(PlanError, match="every pipeline stage"):
        plan_sync([m for m in metas if m.pp_rank == 0], wmap, tp_size=1, pp_size=2)


def _ep_metas(checkpoint, wmap, ep):
    """ParamMeta of a TP1 × EP`ep` layout: EP rank r reports its experts (as local experts) and, on r = 0, the rest."""
    local_experts = wmap.local_experts(ep)
    metas = []
    for mapping in wmap.all_mappings():
        full = mapping.to_mcore(
            [checkpoint[n] for n in mapping.hf], wmap.dims, padded_vocab_size(wmap.dims.vocab_size, 1)
        )
        name, ep_rank = mapping.mcore, 0
        if mapping.expert:
            expert = int(name.split("local_experts.")[1].split(".")[0])
            ep_rank = expert // local_experts
            name = name.replace(f"local_experts.{expert}.", f"local_experts.{expert % local_experts}.")
        metas.append(ParamMeta(name, tuple(full.shape), "float32", 0, 0, 0, ep_rank))
    return metas


def test_ep_plan_takes_each_expert_from_its_ep_rank(tmp_path):
    from safetensors.torch import load_file

    from megarl.testing.models import save_tiny_hf_model

    save_tiny_hf_model("qwen2_moe", tmp_path, seed=0)
    checkpoint = load_file(tmp_path / "model.safetensors")
    wmap = WeightMap(describe_hf_config(tiny_hf_config("qwen2_moe")))
    metas = _ep_metas(checkpoint, wmap, ep=2)
    plan = plan_sync(metas, wmap, tp_size=1, pp_size=1, ep_size=2, bucket_bytes=20_000)
    specs = {s.name: s.shape for s in plan.hf_specs()}
    assert specs == {n: tuple(t.shape) for n, t in checkpoint.items()} and len(plan.hf_specs()) == len(checkpoint)
    from_ep1 = {s.name for b in plan.buckets if b.source == (0, 1) for s in b.hf}
    assert from_ep1 == {n for n in checkpoint if any(f"experts.{e}." in n for e in (2, 3))}
    dense_from_ep1 = ParamMeta("decoder.final_layernorm.weight", (64,), "float32", 0, 0, 0, ep_rank=1)
    with pytest.raises(PlanError, match="reported by EP rank 1"):
        plan_sync(metas + [dense_from_ep1], wmap, tp_size=1, pp_size=1, ep_size=2)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
@pytest.mark.parametrize("tp", [1, 2])  # TP divides the query groups (2)
def test_fused_unshard_to_hf_equals_the_mapping_rules(arch, tp):
    """`Mapping.unshard_to_hf` writes exactly `to_hf(unshard(shards))`, contiguously in HF order, for
    every mapping kind (QKV weight and bias, gate/up, row- and column-parallel, vocab, replicated, and
    a kind with rules of its own, which must take the generic path)."""
    config = tiny_hf_config(arch, num_layers=1)
    dims = describe_hf_config(config)
    wmap = WeightMap(dims)
    torch.manual_seed(0)
    for mapping in wmap.all_mappings() + [_Transposed("x", ("a",), tp_dim=0)]:
        full = torch.randn(_mcore_shape(mapping, dims, tp))
        shards = [mapping.shard(full, r, tp) for r in range(tp)]
        expected = mapping.to_hf(mapping.unshard(shards), dims)
        out = torch.full((sum(t.numel() for t in expected) + 5,), float("nan"))
        got = mapping.unshard_to_hf(shards, dims, out)
        assert [t.shape for t in got] == [t.shape for t in expected], mapping.mcore
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), mapping.mcore
        assert torch.equal(torch.cat([t.reshape(-1) for t in expected]), out[:-5]), mapping.mcore  # in order
        assert out[-5:].isnan().all(), mapping.mcore  # nothing written past the HF tensors


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_tp1_hf_rows_are_the_hf_tensors_rows_of_the_tp1_tensor(arch):
    """`Mapping.tp1_hf_rows` (what the GPU's batched pack copies by): the TP1 tensor's rows it names, in its
    order, are the HF tensors laid end to end; a prefix where it says `range` (vocab padding left out), the
    QKV order elsewhere; None for a kind with rules of its own and for a tensor of the wrong size."""
    dims = describe_hf_config(tiny_hf_config(arch, num_layers=1))
    torch.manual_seed(0)
    kinds = set()
    for mapping in WeightMap(dims).all_mappings():
        full = torch.randn(_mcore_shape(mapping, dims, 2))
        rows = mapping.tp1_hf_rows(dims, full.shape[0], "cpu")
        expected = torch.cat([t.reshape(-1) for t in mapping.to_hf(full, dims)])
        assert torch.equal(full[torch.as_tensor(rows)].reshape(-1), expected), mapping.mcore
        kinds.add((type(mapping).__name__, isinstance(rows, range)))
    assert kinds >= {("Mapping", True), ("VocabMapping", True), ("GateUpMapping", True), ("QKVMapping", False)}
    assert _Transposed("x", ("a",), tp_dim=0).tp1_hf_rows(dims, 4, "cpu") is None
    assert _OwnUnshardToHF("x", ("a",), tp_dim=0).tp1_hf_rows(dims, 4, "cpu") is None
    qkv = next(m for m in WeightMap(dims).all_mappings() if type(m).__name__ == "QKVMapping")
    assert qkv.tp1_hf_rows(dims, 3, "cpu") is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_writes_its_shard_into_the_flat_hf_tensors(arch, tp):
    """`Mapping.shard_to_hf`: TP ranks writing their own shards, each into the same flat buffer, leave
    exactly `unshard_to_hf(shards)` there (q/k/v per query group, gate/up halves, row- and column-parallel
    splits, vocab rows with a rank holding only padding at TP4); a rank writes nothing outside its
    elements. Kinds without the rule (replicated, a class with its own `to_hf`) say so."""
    dims = describe_hf_config(tiny_hf_config(arch, num_layers=1, num_kv_heads=4))  # TP4 divides the query groups
    wmap = WeightMap(dims)
    torch.manual_seed(0)
    writers = [m for m in wmap.all_mappings() if m.writes_shards]
    assert {type(m).__name__ for m in writers} >= {"Mapping", "VocabMapping", "QKVMapping", "GateUpMapping"}
    assert all(m.tp_dim is None for m in wmap.all_mappings() if not m.writes_shards)
    assert not _Transposed("x", ("a",), tp_dim=0).writes_shards
    for mapping in writers:
        full = torch.randn(_mcore_shape(mapping, dims, tp))
        shards = [mapping.shard(full, r, tp) for r in range(tp)]
        numel = sum(t.numel() for t in mapping.to_hf(full, dims))
        expected = torch.empty(numel)
        mapping.unshard_to_hf(shards, dims, expected)
        out = torch.full((numel,), float("nan"))
        for rank, shard in enumerate(shards):
            alone = torch.full((numel,), float("nan"))
            mapping.shard_to_hf(shard, rank, tp, dims, alone)
            written = ~alone.isnan()
            assert torch.equal(alone[written], expected[written]), (mapping.mcore, rank)
            assert not (written & ~out.isnan()).any(), (mapping.mcore, rank)  # no element of another rank's
            out[written] = alone[written]
        assert torch.equal(out, expected), mapping.mcore


class _Transposed(Mapping):
    """A mapping kind with its own to_hf and no fused rule: the generic path must be used."""

    def to_hf(self, full, dims):
        return [full.t()]


class _OwnUnshardToHF(Mapping):
    """A mapping kind whose one-pass export differs from its parent's."""

    def unshard_to_hf(self, shards, dims, out):
        return super().unshard_to_hf([s.flip(0) for s in shards], dims, out)


def _mcore_shape(mapping, dims, tp):
    """The TP1 megatron shape of a mapping (vocab rows padded for `tp`)."""
    if isinstance(mapping, _Transposed):
        return (4 * tp, 3)
    shapes = _shapes_of(dims)
    hf = [torch.empty(shapes[n], device="meta") for n in mapping.hf]
    return tuple(mapping.to_mcore(hf, dims, padded_vocab_size(dims.vocab_size, tp)).shape)


def _shapes_of(dims):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            tiny_hf_config(dims.model_type, num_layers=1, num_kv_heads=dims.num_kv_heads)
        )
    return {n: tuple(p.shape) for n, p in model.state_dict().items()} | _expert_shapes(model, dims)


def _expert_shapes(model, dims):
    """Checkpoint names of fused MoE experts (transformers keeps them as 3-D parameters)."""
    from megarl.rollout.embedded import checkpoint_params

    return {n: tuple(p.shape) for n, p in checkpoint_params(model).items()} if dims.moe else {}


_ONE_LAUNCH_CHECK = """
import dataclasses
import functools
import itertools
from unittest import mock
import torch
from transformers import AutoModelForCausalLM
from test_sharding_plan import fake_training_layout
from megarl.models.hf_config import describe_hf_config
from megarl.rollout.sharding import devicesum, pack, transport
from megarl.rollout.sharding.plan import plan_sync
from megarl.rollout.sharding.protocol import FlatBucket, checksums
from megarl.testing.models import tiny_hf_config

assert devicesum.available(torch.device("cpu"))
devicesum.PIECE, devicesum.BLOCK = 256, 64  # runs of several pieces, pieces of several loop steps
torch.manual_seed(0)
f32, bf16, odd = torch.float32, torch.bfloat16, dict(hidden_size=68, num_heads=4, num_kv_heads=2)
CASES = [("qwen2", {}, 1, 2, 2, f32), ("qwen2", {}, 2, 2, 1, f32), ("llama", {}, 1, 1, 1, f32), ("qwen3", {}, 2, 1, 1, f32)]
CASES += [("qwen2", {}, 1, 1, 1, bf16), ("qwen2", odd, 1, 1, 1, bf16)]  # odd: 17-wide heads, QKV bias off words
summed = fallbacks = 0
for arch, size, tp, pp, vpp, dtype in CASES:
    config = tiny_hf_config(arch, num_layers=4, **size)
    dims = describe_hf_config(config)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    hf = {n: torch.randn(s).to(dtype) for n, s in shapes.items() if not (n == "lm_head.weight" and dims.tie_word_embeddings)}
    layouts = [fake_training_layout(config, tp, pp, vpp, rank=r, value=hf) for r in range(tp)]
    wmap, metas, _ = layouts[0]
    metas = [dataclasses.replace(m, dtype=str(dtype).removeprefix("torch.")) for m in metas]
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=pp, bucket_bytes=20_000)
    for bucket, (_, _, local) in itertools.product(plan.buckets, layouts):
        # as megatron holds them: contiguous (the layout's row-parallel shards are views)
        params = {(vp, name): t.contiguous() for (p, vp, name), t in local.items() if p == bucket.pp_rank}
        for moved in (False, True):  # new parameters elsewhere in memory (the old ones alive): the table follows
            if moved:
                params = {key: t + 1.0 for key, t in params.items()}
            reference = pack.pack_bucket(bucket, params, wmap.dims, batched=False)
            nan = torch.full((bucket.local_numel,), float("nan"), dtype=dtype)
            with mock.patch.object(pack, "_pack_batched", None if not size else pack._pack_batched):
                buf, sums = pack.pack_bucket_summed(bucket, params, wmap.dims, out=nan, batched=True)  # no fallback
            assert torch.equal(buf.view(-1, 1).view(torch.uint8), reference.view(-1, 1).view(torch.uint8)), bucket.index
            if bucket.sharded:
                assert sums is None
            elif sums is None:
                fallbacks += 1
            else:
                assert torch.equal(sums, checksums(FlatBucket(buf, bucket.entries))), (arch, bucket.index)
                summed += 1
    if (tp, pp, dtype) == (1, 1, f32):  # the rollout rank's own pack (GPU: batched) hands its sums to the sync
        local_params = {(vp, name): t.contiguous() for (_, vp, name), t in layouts[0][2].items()}
        batched = functools.partial(pack.pack_bucket_summed, batched=True)
        with mock.patch.object(transport, "pack_bucket_summed", batched):
            for bucket, gathered, _, sums in transport.stream_buckets(
                plan.buckets, local_params, my_rank=0, stage_ranks={(0, 0): [0]}, dest_ranks=[0], my_source=(0, 0),
                dims=wmap.dims
            ):  # a buffer is valid until the next bucket is asked for
                flat = FlatBucket(gathered.view(-1)[: bucket.hf_numel], bucket.entries)
                assert sums is not None and torch.equal(sums, checksums(flat)), bucket.index
                summed += 1
        # a parameter that is not as planned (here: not contiguous) packs the other way, every byte the same
        bucket = next(b for b in plan.buckets if any(len(p.meta.shape) == 2 for p in b.params))
        key = next((p.meta.vp_stage, p.meta.name) for p in bucket.params if len(p.meta.shape) == 2)
        local_params[key] = local_params[key].T.contiguous().T
        buf, sums = pack.pack_bucket_summed(bucket, local_params, wmap.dims, batched=True)
        assert sums is None and torch.equal(buf, pack.pack_bucket(bucket, local_params, wmap.dims, batched=False))
print("ok", summed, fallbacks)
"""


def test_the_one_launch_pack_writes_the_same_bytes_and_the_checksums_of_the_bucket():
    """The GPU's pack of a bucket in one Triton launch (`pack.pack_bucket_summed`: every run of rows copied as
    8-byte words, summed per HF tensor as written), run by Triton's interpreter on CPU tensors (a fresh
    interpreter: TRITON_INTERPRET is read when the kernel is defined): bit for bit the per-tensor pack of every
    bucket (QKV split per group with its bias, gate/up, vocabulary rows, TP shards, PP and VPP stages), also
    after the parameters moved in memory; a replicated bucket's sums equal `protocol.checksums` of the flat
    bucket, and the transport yields them with it; a parameter not as planned, or a run off an 8-byte word (bf16
    heads 17 wide), takes the other path."""
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(
        [sys.executable, "-c", _ONE_LAUNCH_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()  # ok, buckets packed with their sums, buckets whose runs are off words
    assert words[0] == "ok" and int(words[1]) > 10 and int(words[2]) > 0, done.stdout
