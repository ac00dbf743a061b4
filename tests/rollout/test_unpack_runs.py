"""The GPU's unpack of a sharded bucket in one Triton launch (`unpack_runs`), run by Triton's interpreter on CPU."""

import os
import subprocess
import sys
from pathlib import Path

_CHECK = """
import dataclasses
import itertools
import torch
from transformers import AutoModelForCausalLM
from test_sharding_plan import fake_training_layout
from megarl.models.hf_config import describe_hf_config
from megarl.models.mapping import GateUpMapping, VocabMapping
from megarl.rollout.sharding import devicesum, pack
from megarl.rollout.sharding.plan import plan_sync
from megarl.rollout.sharding.protocol import FlatBucket, checksums
from megarl.testing.models import tiny_hf_config

assert devicesum.available(torch.device("cpu"))
devicesum.PIECE, devicesum.BLOCK = 256, 64  # runs of several pieces, pieces of several loop steps
torch.manual_seed(0)
f32, bf16, odd = torch.float32, torch.bfloat16, dict(hidden_size=68, num_heads=4, num_kv_heads=2)
CASES = [("qwen2", {}, 2, bf16, 20_000), ("llama", dict(num_kv_heads=4), 4, bf16, 20_000), ("qwen3", {}, 2, f32, 20_000)]
CASES += [("qwen2", {}, 2, bf16, 1 << 20), ("qwen2", odd, 2, bf16, 20_000)]  # one bucket of everything (tied vocab)
launched = fallbacks = mixed = 0


def same_bytes(a, b):
    return torch.equal(a.view(-1, 1).view(torch.uint8), b.view(-1, 1).view(torch.uint8))


class Offset(GateUpMapping):  # a mapping class of the user's own whose rule adds to what it moves: on the
    def unshard_to_hf(self, shards, dims, out):  # trace's indices +4 reads as a move by one word
        tensors = super().unshard_to_hf(shards, dims, out)
        out.add_(4)
        return tensors



spent = []  # every source unpacked so far, kept alive and poisoned: a table left on an old one reads NaN
for arch, size, tp, dtype, bucket_bytes in CASES:
    config = tiny_hf_config(arch, num_layers=2, **size)
    dims = describe_hf_config(config)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    tied = dims.tie_word_embeddings
    hf = {n: torch.randn(s).to(dtype) for n, s in shapes.items() if not (n == "lm_head.weight" and tied)}
    layouts = [fake_training_layout(config, tp, 1, rank=r, value=hf) for r in range(tp)]
    wmap, metas, _ = layouts[0]
    metas = [dataclasses.replace(m, dtype=str(dtype).removeprefix("torch.")) for m in metas]
    plan = plan_sync(metas, wmap, tp_size=tp, pp_size=1, bucket_bytes=bucket_bytes)
    ranks = [{(vp, name): t.contiguous() for (_, vp, name), t in local.items()} for _, _, local in layouts]
    for bucket in [b for b in plan.buckets if b.sharded and not b.arrives_flat]:
        gathered = torch.cat([pack.pack_bucket(bucket, params, wmap.dims, batched=False) for params in ranks])
        reference = pack.unpack_bucket(bucket, gathered, wmap.dims, batched=False)
        assert reference.sums is None
        for own_row, _ in itertools.product((None, 0, tp - 1), range(2)):  # each time elsewhere in memory
            source = gathered.clone()
            own = None
            if own_row is not None:  # that row never packed: read from the rank's parameters
                source = source.view(tp, -1).clone()
                source[own_row] = float("nan")
                source = source.view(-1)
                own = (own_row, ranks[own_row])
            out = torch.full((bucket.hf_numel,), float("nan"), dtype=dtype)
            flat = pack.unpack_bucket(bucket, source, wmap.dims, out, own, batched=True)
            assert same_bytes(flat.buffer, reference.buffer), (arch, bucket.index, own_row)
            source.fill_(float("nan"))
            spent.append(source)
            if flat.sums is None:
                fallbacks += 1
            else:
                assert torch.equal(flat.sums, checksums(FlatBucket(flat.buffer, bucket.entries))), bucket.index
                launched += 1
                mixed += len(bucket.params) > 2 and any(type(p.mapping) is VocabMapping for p in bucket.params)
    if (arch, tp) == ("qwen2", 2) and not size:  # a bucket with a mapping of the user's own keeps its rules
        bucket = next(b for b in plan.buckets if b.sharded and any(type(p.mapping) is GateUpMapping for p in b.params))
        fields = lambda m: {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        own_class = tuple(
            dataclasses.replace(p, mapping=Offset(**fields(p.mapping))) if type(p.mapping) is GateUpMapping else p
            for p in bucket.params
        )
        bucket = dataclasses.replace(bucket, params=own_class)
        gathered = torch.cat([pack.pack_bucket(bucket, params, wmap.dims, batched=False) for params in ranks])
        reference = pack.unpack_bucket(bucket, gathered, wmap.dims, batched=False)
        flat = pack.unpack_bucket(bucket, gathered, wmap.dims, batched=True)
        assert flat.sums is None and same_bytes(flat.buffer, reference.buffer)
        assert devicesum.available(torch.device("cpu"), "piece_copy_sums")  # not tried (and failed) on it
        fallbacks += 1
assert mixed, "no bucket held the vocabulary beside other parameters"
print("ok", launched, fallbacks)
"""


def test_the_one_launch_unpack_writes_what_the_rules_write_and_the_checksums():
    """Every sharded bucket (QKV with and without bias, gate/up, row-parallel weights; TP 2 and 4; bf16 and float32;
    also all of a model in one bucket, its tied vocabulary's rows beside the layers) unpacked in one launch holds
    the rules' bytes bit for bit, also with the rollout rank's own row read from its parameters (first and last
    row), each time from rows elsewhere in memory (the ones before poisoned, still alive); its sums
    equal `protocol.checksums` of the flat bucket; a layout off 8-byte words (bf16 heads 17 wide) keeps the
    rules. The interpreter runs in a fresh process: TRITON_INTERPRET is read when the kernel is defined."""
    here = str(Path(__file__).parent)
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()  # ok, buckets unpacked in one launch, buckets that kept the rules
    assert words[0] == "ok" and int(words[1]) > 20 and int(words[2]) > 0, done.stdout


def test_a_bucket_without_room_to_derive_its_runs_keeps_the_rules(monkeypatch, caplog):
    """Deriving the runs needs a few times the bucket's bytes on its device once; where that memory is not there
    the bucket is unpacked by its rules (the same bytes, no sums) and says why, and is not derived again."""
    import torch
    from test_sharding_plan import fake_training_layout

    from megarl.rollout.sharding import devicesum, pack, unpack_runs
    from megarl.rollout.sharding.plan import plan_sync
    from megarl.testing.models import tiny_hf_config

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # `available` then accepts CPU tensors
    monkeypatch.setattr(devicesum, "_FAILED", {})
    tries = []

    def no_memory(*args):
        tries.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(unpack_runs, "_param_runs", no_memory)
    config = tiny_hf_config("llama", num_layers=2)
    layouts = [fake_training_layout(config, 2, 1, rank=r) for r in range(2)]
    wmap, metas, _ = layouts[0]
    ranks = [{(vp, n): torch.randn(t.shape) for (_, vp, n), t in local.items()} for _, _, local in layouts]
    plan = plan_sync(metas, wmap, tp_size=2, pp_size=1, bucket_bytes=20_000)
    bucket = next(b for b in plan.buckets if b.sharded and not b.arrives_flat)
    gathered = torch.cat([pack.pack_bucket(bucket, params, wmap.dims) for params in ranks])
    reference = pack.unpack_bucket(bucket, gathered, wmap.dims, batched=False)
    with caplog.at_level("WARNING", logger=unpack_runs.__name__):
        for _ in range(2):
            flat = pack.unpack_bucket(bucket, gathered, wmap.dims, batched=True)
            assert flat.sums is None and torch.equal(flat.buffer, reference.buffer)
    assert len(tries) == 1 and "no memory to derive" in caplog.text and "keeps the rules" in caplog.text
