"""The sharding planner: training-layout parameter metadata in, ordered buckets of HF tensors out.

Pure (torch + `megarl.models.mapping` / `weight_map` only; no process groups, no megatron): it never touches
parameter values, so it is tested on CPU with made-up metadata and every transport
(`transport.py`, `broadcast.py`, `ipc.py`) moves bytes by the same plan.

Input: one `ParamMeta` per megatron parameter of one TP rank of every pipeline stage (shapes are
the local TP shard; all TP ranks of a stage hold the same shapes), plus the TP (and EP) size and
the model's `WeightMap`. With expert parallelism (MoE), a *source* is one (pipeline stage, EP
rank): EP rank 0 reports every parameter, the other EP ranks only their routed experts' weights
(`Mapping.expert`), which the weight map numbers globally from the meta's `ep_rank`. Output: a `SyncPlan`, a list of `Bucket`s in transfer order (HF order within
a source, the sources' buckets merged by bytes so that they ship concurrently: `_transfer_order`). A bucket holds the
parameters of one source (stage, EP rank), one dtype, and one kind:

* sharded buckets: every TP rank packs its shards into one flat buffer and the rollout rank
  receives them (one message per TP rank); it cuts each parameter's shards out and writes the HF
  tensors into one output buffer (`Mapping.unshard_to_hf`: QKV per query group, fc1 [gate; up]
  per shard, row-parallel on dim 1, vocab rows without the padding);
* replicated buckets (norms, a value head, and every bucket at TP1): the stage's first TP rank
  packs the HF tensors themselves (`unshard_to_hf` of its one shard), so the received buffer *is*
  the bucket the engine loads;
* a sharded bucket of one parameter whose HF tensor is its shards laid end to end (split on dim 0,
  vocab padding last: an embedding or output layer alone in its bucket,
  `Mapping.hf_is_shards_in_order`) needs no unpacking either: the HF tensor is the first elements
  of the gathered buffer (`Bucket.arrives_flat`);
* ranks on one CPU host (`transport`, `shm.py`) write a sharded bucket's shards in HF layout straight
  into the rollout rank's buffer where every mapping can place one rank's shard
  (`Bucket.shards_write_flat`, `Mapping.shard_to_hf`): nothing to unpack there either.

Either way a bucket reaches the engine as one flat buffer in which every HF tensor is a contiguous
slice, in order: `Bucket.entries` gives each one's (name, shape, offset).

A bucket's size is the bytes of its gathered parameters; the planner closes a bucket before it
would exceed `bucket_bytes` (one parameter larger than the bound gets a bucket of its own).
The last stage's copy of tied embeddings is never planned (the first stage's embedding is the
HF tensor). Virtual pipeline stages are separate chunks of the same stage: their layer offsets
make the HF layer numbers global.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

import torch

from megarl.models.mapping import Mapping
from megarl.models.weight_map import WeightMap

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class ParamMeta:
    """One megatron parameter of one model chunk, as one TP rank holds it."""

    name: str
    """Chunk-local megatron name (wrappers like `module.` allowed; layer numbers local to the chunk)."""
    shape: tuple[int, ...]
    """Shape of this TP rank's shard."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. "float32"."""
    pp_rank: int
    vp_stage: int
    """Index of the chunk on its pipeline rank (0 without virtual stages)."""
    layer_offset: int
    """Global index of the chunk's first transformer layer."""
    ep_rank: int = 0
    """Expert-parallel rank of the reporting rank: its local experts are experts ep_rank * E/ep + i."""


@dataclass(frozen=True)
class HFSpec:
    """One HF tensor the rollout engine receives."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class HFSlot(NamedTuple):
    """Where one HF tensor lies in its bucket's flat buffer (elements, not bytes)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class PlannedParam:
    """A megatron parameter inside a bucket: where its shard sits in each TP rank's flat buffer."""

    meta: ParamMeta
    mapping: Mapping
    hf: tuple[HFSpec, ...]
    offset: int
    """Element offset in the bucket's per-rank buffer: of the shard (sharded buckets), of the HF
    tensors (replicated buckets, which are packed in HF layout)."""

    @property
    def numel(self) -> int:
        return _numel(self.meta.shape)

    @functools.cached_property
    def hf_numel(self) -> int:
        """Elements of the HF tensors (fewer than the TP1 tensor's where vocab padding is dropped)."""
        return sum(_numel(spec.shape) for spec in self.hf)


@dataclass(frozen=True)
class Bucket:
    """Parameters of one pipeline stage and dtype, moved together with one collective."""

    index: int
    pp_rank: int
    dtype: torch.dtype
    sharded: bool
    """True: gather TP shards (one collective); False: replicated, read from the first TP rank."""
    params: tuple[PlannedParam, ...]
    tp_size: int
    ep_rank: int = 0
    """With EP: the EP rank whose TP ranks (of stage `pp_rank`) hold the bucket."""

    @property
    def source(self) -> tuple[int, int]:
        """(pp_rank, ep_rank): the key of the TP ranks that send this bucket."""
        return self.pp_rank, self.ep_rank

    @property
    def arrives_flat(self) -> bool:
        """True when the received (gathered) buffer starts with the flat bucket as it is: a replicated
        bucket, or a sharded one of a single parameter whose HF tensor is its shards in order. The
        rollout rank then copies nothing after the bytes arrive."""
        return not self.sharded or (len(self.params) == 1 and self.params[0].mapping.hf_is_shards_in_order)

    @property
    def shards_write_flat(self) -> bool:
        """True for a sharded bucket whose every parameter can place one TP rank's shard straight
        into the flat bucket (`Mapping.writes_shards`): over shared memory the TP ranks then write
        the flat bucket themselves and the rollout rank unpacks nothing."""
        return self.sharded and all(p.mapping.writes_shards for p in self.params)

    @property
    def local_numel(self) -> int:
        """Elements one TP rank packs: its shards (sharded), the HF tensors (replicated)."""
        return sum(p.numel for p in self.params) if self.sharded else self.hf_numel

    @property
    def gathered_numel(self) -> int:
        """Elements after the TP gather (what the receiver holds)."""
        return self.local_numel * (self.tp_size if self.sharded else 1)

    @functools.cached_property
    def hf_numel(self) -> int:
        """Elements of the bucket's HF tensors (its flat buffer)."""
        return sum(p.hf_numel for p in self.params)

    @functools.cached_property
    def memo(self) -> dict:
        """What code that reads the bucket every sync derives from it once (`pack`'s one-launch copy runs, per
        model dims); not part of the plan."""
        return {}

    @functools.cached_property
    def entries(self) -> tuple[HFSlot, ...]:
        """Every HF tensor's place in the bucket's flat buffer: contiguous, in order, from 0."""
        slots, offset = [], 0
        for spec in self.hf:
            slots.append(HFSlot(spec.name, tuple(spec.shape), offset))
            offset += _numel(spec.shape)
        return tuple(slots)

    @property
    def nbytes(self) -> int:
        return self.gathered_numel * _itemsize(self.dtype)

    @property
    def hf(self) -> list[HFSpec]:
        return [spec for p in self.params for spec in p.hf]


@dataclass
class SyncPlan:
    """Buckets in transfer order (`_transfer_order`) covering every HF tensor exactly once."""

    buckets: list[Bucket]
    tp_size: int
    pp_size: int
    bucket_bytes: int
    _specs: list[HFSpec] = field(default=None, repr=False)

    def hf_specs(self) -> list[HFSpec]:
        """Every HF tensor (name, shape, dtype) in transfer order — what the engine validates up front."""
        if self._specs is None:
            self._specs = [spec for bucket in self.buckets for spec in bucket.hf]
        return self._specs

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def buckets_of_stage(self, pp_rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.pp_rank == pp_rank]


class PlanError(ValueError):
    """The training-layout metadata does not describe the model the weight map knows."""


def plan_sync(
    metas: Iterable[ParamMeta],
    weight_map: WeightMap,
    *,
    tp_size: int,
    pp_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ep_size: int = 1,
) -> SyncPlan:
    """Buckets (≤ `bucket_bytes` gathered bytes each) of HF tensors for one full model, in HF order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0; got {bucket_bytes}")
    planned = _planned_params(metas, weight_map, tp_size, ep_size)
    _check_complete(planned, weight_map)
    sources = [(pp_rank, ep_rank) for pp_rank in range(pp_size) for ep_rank in range(ep_size)]
    per_source = [
        _pack_stage([p for p in planned if (p.meta.pp_rank, p.meta.ep_rank) == source], source, tp_size, bucket_bytes)
        for source in sources
    ]
    buckets = [dataclasses.replace(b, index=i) for i, b in enumerate(_transfer_order(per_source, bucket_bytes))]
    return SyncPlan(buckets, tp_size, pp_size, bucket_bytes)


def _transfer_order(per_source: list[list[Bucket]], bucket_bytes: int) -> list[Bucket]:
    """Every source's buckets (each list in its own order): the small ones first (under an eighth of the bound:
    a stage's bucket of norms), then the large ones merged by bytes, the next always from the source with the
    fewest bytes planned so far. Consecutive large buckets then come from different sources wherever the bytes
    allow, so one source's ranks write the next bucket while the rollout rank's consumer takes the current one. (A plain round robin
    made a 0.4 GB TP2×PP2 sync [stage 0's layers, stage 1's norms, stage 0's norms, stage 1's layers]: stage 1
    began writing only once the broadcast receiver had copied stage 0's layers.) Any order is valid: a
    parameter's HF tensors never span two buckets."""
    small = bucket_bytes // 8
    first = _merged_by_bytes([[b for b in buckets if b.nbytes < small] for buckets in per_source])
    return first + _merged_by_bytes([[b for b in buckets if b.nbytes >= small] for buckets in per_source])


def _merged_by_bytes(per_source: list[list[Bucket]]) -> list[Bucket]:
    queues = [list(reversed(buckets)) for buckets in per_source]  # popped from the end
    planned = [0] * len(queues)
    ordered = []
    while any(queues):
        turn = min((i for i, q in enumerate(queues) if q), key=lambda i: planned[i])
        ordered.append(queues[turn].pop())
        planned[turn] += ordered[-1].nbytes
    return ordered


def _planned_params(
    metas: Iterable[ParamMeta], weight_map: WeightMap, tp_size: int, ep_size: int = 1
) -> list[PlannedParam]:
    """(mapping, HF specs) for every exported parameter, sorted into HF order (by global layer)."""
    order = {name: i for i, name in enumerate(weight_map.hf_names())}
    out = []
    for meta in metas:
        if weight_map.is_tied_copy(meta.name):
            continue
        mapping = weight_map.lookup(meta.name, meta.layer_offset, meta.ep_rank * weight_map.local_experts(ep_size))
        if meta.ep_rank and not mapping.expert:
            raise PlanError(
                f"{meta.name} is reported by EP rank {meta.ep_rank}: only EP rank 0 reports"
                " parameters that are not routed-expert weights"
            )
        out.append(PlannedParam(meta, mapping, _hf_specs(meta, mapping, weight_map, tp_size), offset=0))
    return sorted(out, key=lambda p: order[p.mapping.hf[0]])


def _hf_specs(meta: ParamMeta, mapping: Mapping, weight_map: WeightMap, tp_size: int) -> tuple[HFSpec, ...]:
    """Shapes of the HF tensors, computed by running the real unshard/to_hf on meta tensors."""
    dtype = getattr(torch, meta.dtype)
    shard = torch.empty(meta.shape, dtype=dtype, device="meta")
    shards = [shard] * (tp_size if mapping.tp_dim is not None else 1)
    full = mapping.unshard(shards)
    return tuple(HFSpec(n, tuple(t.shape), dtype) for n, t in zip(mapping.hf, mapping.to_hf(full, weight_map.dims)))


def _check_complete(planned: Sequence[PlannedParam], weight_map: WeightMap) -> None:
    seen: dict[str, ParamMeta] = {}
    for p in planned:
        for spec in p.hf:
            if spec.name in seen:
                raise PlanError(
                    f"HF tensor {spec.name} is produced twice (by {seen[spec.name]} and {p.meta});"
                    " are two ranks reporting the same pipeline stage?"
                )
            seen[spec.name] = p.meta
    missing = [n for n in weight_map.hf_names() if n not in seen]
    if missing:
        raise PlanError(
            f"no training rank holds {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            f" ({len(missing)} HF tensors); metadata from every pipeline stage is needed"
        )


def _pack_stage(params: list[PlannedParam], source: tuple[int, int], tp_size: int, bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in HF order; one open bucket per (dtype, sharded) kind."""
    closed: list[tuple[int, Bucket]] = []
    open_: dict[tuple[torch.dtype, bool], list[PlannedParam]] = {}
    order_of = {}

    def close(key):
        members = open_.pop(key)
        closed.append((order_of.pop(key), _bucket(members, source, key, tp_size)))

    for position, param in enumerate(params):
        sharded = param.mapping.tp_dim is not None and tp_size > 1
        key = (param.hf[0].dtype, sharded)
        gathered = param.numel * (tp_size if sharded else 1) * _itemsize(key[0])
        current = open_.get(key, [])
        current_bytes = sum(p.numel for p in current) * (tp_size if sharded else 1) * _itemsize(key[0])
        if current and current_bytes + gathered > bucket_bytes:
            close(key)
        open_.setdefault(key, []).append(param)
        order_of.setdefault(key, position)
    for key in list(open_):
        close(key)
    closed.sort(key=lambda item: item[0])
    return [b for _, b in closed]


def _bucket(members: list[PlannedParam], source: tuple[int, int], key, tp_size: int) -> Bucket:
    dtype, sharded = key
    placed, offset = [], 0
    for p in members:
        placed.append(PlannedParam(p.meta, p.mapping, p.hf, offset))
        offset += p.numel if sharded else p.hf_numel
    return Bucket(0, source[0], dtype, sharded, tuple(placed), tp_size, ep_rank=source[1])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
