"""Split/merge rules between HuggingFace and megatron-core weights.

Owns: `Mapping` and its kinds (vocab, QKV, gate/up): for one megatron-core parameter, its HF source
names, how the HF tensors combine into megatron's TP1 layout, how that layout splits across TP
ranks, and how shards go back to HF tensors (all at once, `unshard_to_hf`, or one rank's shard into
its place, `shard_to_hf`). Which parameter has which mapping: `weight_map.py`'s tables. Pure torch:
must not import megatron, vLLM or Ray (the sharding planner uses it too).

Megatron layouts (TP1, the "full" tensor):
* QKV is stored by query group: [groups, q_per_group + 2, head_dim, hidden] flattened to 2-D,
  so a TP shard is a run of whole groups.
* `linear_fc1` holds [gate; up]; every TP shard holds [gate_shard; up_shard].
* Row-parallel weights (`linear_proj`, `linear_fc2`) split on dim 1; column-parallel on dim 0.
* Embedding / output rows are padded to the padded vocab size and split on dim 0.
* Norms (and the scalar value head) are replicated.
* MoE: the router (`mlp.router.weight`, [experts, hidden]) is replicated. Routed experts are
  megatron-core `SequentialMLP`s (`mlp.experts.local_experts.{i}.linear_fc1/linear_fc2`): expert
  parallelism gives EP rank r the global experts [r*E/ep, (r+1)*E/ep) as local experts 0..E/ep-1,
  and expert TP (megatron's default: the TP size) splits each expert like the dense MLP. Tables
  hold `{expert}` in both names; `WeightMap.lookup` turns a local expert number global.
  Qwen2-MoE's shared expert is `mlp.shared_experts` (a dense MLP) with its sigmoid gate
  `mlp.shared_experts.gate_weight` ([1, hidden], replicated).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from megarl.models.hf_config import ModelDims

LAYER = "{layer}"
EXPERT = "{expert}"


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of `divisible_by * tp` rows."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Mapping:
    """A megatron parameter that is a single HF tensor, split on `tp_dim` (None: replicated)."""

    mcore: str
    hf: tuple[str, ...]
    tp_dim: int | None = None
    expert: bool = False
    """A routed expert's weight: split over EP by expert number, over expert-TP like a dense weight."""

    def to_mcore(self, hf_tensors: Sequence[torch.Tensor], dims: ModelDims, padded_vocab: int) -> torch.Tensor:
        """HF tensors (in `self.hf` order) → the megatron TP1 tensor."""
        return hf_tensors[0]

    def to_hf(self, full: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
        """The megatron TP1 tensor → HF tensors (in `self.hf` order)."""
        return [full]

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """The slice of the TP1 tensor that TP rank `rank` of `size` holds."""
        if self.tp_dim is None or size == 1:
            return full
        return full.chunk(size, dim=self.tp_dim)[rank]

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: the TP1 tensor from every TP rank's slice, in rank order."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        return torch.cat(list(shards), dim=self.tp_dim)

    def load_shard(self, reader, dims: ModelDims, padded_vocab: int, rank: int, size: int, out: torch.Tensor) -> None:
        """`out.copy_(shard(to_mcore(HF tensors), rank, size))`, reading only the rows of the HF tensors that
        TP rank `rank` holds (`reader.rows`; `out` is the rank's parameter) and no full tensor in between.

        A subclass that changes `to_mcore` or `shard` gets that generic rule (full tensors read) unless
        it overrides this method too. Raises ValueError when an HF tensor does not fit `out`.
        """
        plain = type(self).to_mcore is Mapping.to_mcore and type(self).shard is Mapping.shard
        if not plain:
            local = self.shard(self.to_mcore([reader.get(n) for n in self.hf], dims, padded_vocab), rank, size)
            _check_fits(self, local.shape, out.shape)
            out.copy_(local)
            return
        name, dim = self.hf[0], self.tp_dim if size > 1 else None
        shape = reader.shape(name)
        expected = list(out.shape)
        if dim is not None:
            expected[dim] *= size
        _check_fits(self, shape, expected)
        if dim is None:
            out.copy_(reader.get(name))
        else:
            step = out.shape[dim]
            out.copy_(reader.rows(name, rank * step, (rank + 1) * step, dim))

    def unshard_to_hf(self, shards: Sequence[torch.Tensor], dims: ModelDims, out: torch.Tensor) -> list[torch.Tensor]:
        """`to_hf(unshard(shards))` written once into the flat buffer `out`; returns the HF tensors as views.

        The HF tensors lie in `out` one after another, contiguous, in `self.hf` order, from offset 0
        (`out` needs their total numel). One shard (TP1, or a replicated weight) converts that shard.
        The generic rule materialises the TP1 tensor first; concatenation (this class and vocab),
        QKV and gate/up write straight from the shards. A subclass that changes `unshard` or `to_hf`
        gets the generic rule unless it overrides this method too.
        """
        plain = type(self).unshard is Mapping.unshard and type(self).to_hf is Mapping.to_hf
        if plain and self.tp_dim is not None and len(shards) > 1:
            shape = list(shards[0].shape)
            shape[self.tp_dim] = sum(s.shape[self.tp_dim] for s in shards)
            full = _flat_view(out, 0, shape)
            torch.cat(list(shards), dim=self.tp_dim, out=full)
            return [full]
        return write_flat(self.to_hf(self.unshard(shards), dims), out)

    @property
    def hf_is_shards_in_order(self) -> bool:
        """True when the one HF tensor is the first elements of the TP shards laid end to end, in rank
        order (split on dim 0; `to_hf` at most drops trailing rows): a buffer holding the contiguous
        shards one after another then holds the HF tensor, with no copy. False for any subclass that
        changes `unshard` or `to_hf` unless it says otherwise."""
        plain = type(self).unshard is Mapping.unshard and type(self).to_hf is Mapping.to_hf
        return plain and self.tp_dim == 0 and len(self.hf) == 1

    def tp1_hf_rows(self, dims: ModelDims, rows: int, device) -> range | torch.Tensor | None:
        """The HF tensors, laid end to end, as rows (dim 0) of the TP1 tensor of `rows` rows: `range(n)` where
        they are its first n rows as they lie (a prefix copy), row indices (int64 on `device`) where they are
        its rows in another order (one `index_select`: QKV); None where neither holds (a class that changes
        `unshard`, `to_hf` or `unshard_to_hf` says None unless it overrides this too). `pack.pack_bucket`
        batches its copies by it: they stand for `unshard_to_hf([tp1_tensor])`."""
        return range(rows) if _uses(self, Mapping, *_TP1_RULES) else None

    def shard_to_hf(self, shard: torch.Tensor, rank: int, size: int, dims: ModelDims, out: torch.Tensor) -> None:
        """Write TP rank `rank`'s shard (of `size`) into its place in the flat HF buffer that
        `unshard_to_hf` fills: the ranks' writes together equal `unshard_to_hf(shards)`, and each
        touches only its own elements (a rank can write from its own process into shared memory).
        Only where `writes_shards` (a split weight with this class's rules)."""
        shape = list(shard.shape)
        shape[self.tp_dim] *= size
        step = shard.shape[self.tp_dim]
        _flat_view(out, 0, shape).narrow(self.tp_dim, rank * step, step).copy_(shard)

    @property
    def writes_shards(self) -> bool:
        """True when `shard_to_hf` holds for this mapping: a split weight whose class keeps (or
        overrides together) `unshard`, `to_hf`, `unshard_to_hf` and `shard_to_hf`."""
        return self.tp_dim is not None and _uses(self, Mapping, "unshard", "to_hf", "unshard_to_hf", "shard_to_hf")

    def with_layer(self, layer: int, expert: int | None = None) -> "Mapping":
        """This mapping with `{layer}` (and `{expert}`, for expert weights) filled in."""

        def fill(name: str) -> str:
            name = name.replace(LAYER, str(layer))
            return name.replace(EXPERT, str(expert)) if expert is not None else name

        return dataclasses.replace(self, mcore=fill(self.mcore), hf=tuple(fill(n) for n in self.hf))


@dataclass(frozen=True)
class VocabMapping(Mapping):
    """Embedding / output layer: rows padded to the padded vocabulary, split on dim 0."""

    tp_dim: int | None = 0

    def _check_rows(self, rows: int, dims: ModelDims) -> None:
        if rows != dims.vocab_size:
            raise ValueError(
                f"{self.hf[0]} has {rows} rows but vocab_size={dims.vocab_size}: the weights"
                " do not fit the model; does config.json match the weights?"
            )

    def to_mcore(self, hf_tensors, dims, padded_vocab):
        weight = hf_tensors[0]
        self._check_rows(weight.shape[0], dims)
        padding = weight.new_zeros(padded_vocab - weight.shape[0], *weight.shape[1:])
        return torch.cat([weight, padding], dim=0)

    def to_hf(self, full, dims):
        return [full[: dims.vocab_size]]

    def load_shard(self, reader, dims, padded_vocab, rank, size, out):
        """The rank's rows of the padded vocabulary: the real rows it holds are read, the padding zeroed."""
        rows = reader.shape(self.hf[0])
        self._check_rows(rows[0], dims)
        _check_fits(self, (padded_vocab, *rows[1:]), (out.shape[0] * size, *out.shape[1:]))
        start = rank * out.shape[0]
        take = max(0, min(out.shape[0], dims.vocab_size - start))
        if take:
            out[:take].copy_(reader.rows(self.hf[0], start, start + take))
        out[take:].zero_()

    @property
    def hf_is_shards_in_order(self) -> bool:
        """The real vocabulary rows come first, the padding rows last: the shards end to end."""
        return type(self).to_hf is VocabMapping.to_hf and type(self).unshard is Mapping.unshard and self.tp_dim == 0

    def tp1_hf_rows(self, dims, rows, device):
        """The real vocabulary rows: the padding rows come last."""
        return range(dims.vocab_size) if _uses(self, VocabMapping, *_TP1_RULES) else None

    def unshard_to_hf(self, shards, dims, out):
        """The real vocabulary rows of the shards, in rank order; padding rows are never copied."""
        full = _flat_view(out, 0, (dims.vocab_size, *shards[0].shape[1:]))
        row = 0
        for shard in shards:
            take = min(shard.shape[0], dims.vocab_size - row)
            if take <= 0:
                break
            full[row : row + take].copy_(shard[:take])
            row += take
        return [full]

    def shard_to_hf(self, shard, rank, size, dims, out):
        """The real vocabulary rows of this rank's shard (none for a shard of padding only)."""
        start = rank * shard.shape[0]
        take = min(shard.shape[0], dims.vocab_size - start)
        if take > 0:
            _flat_view(out, 0, (dims.vocab_size, *shard.shape[1:]))[start : start + take].copy_(shard[:take])

    @property
    def writes_shards(self) -> bool:
        return self.tp_dim == 0 and _uses(self, VocabMapping, "unshard", "to_hf", "unshard_to_hf", "shard_to_hf")


@dataclass(frozen=True)
class QKVMapping(Mapping):
    """q, k, v projections (weight or bias) ↔ megatron's per-query-group fused QKV."""

    tp_dim: int | None = 0

    def to_mcore(self, hf_tensors, dims, padded_vocab):
        q, k, v = hf_tensors
        groups, head_dim = dims.num_kv_heads, dims.head_dim
        q_per_group = dims.num_heads // groups
        rest = q.shape[1:]
        fused = torch.cat(
            [
                q.reshape(groups, q_per_group * head_dim, *rest),
                k.reshape(groups, head_dim, *rest),
                v.reshape(groups, head_dim, *rest),
            ],
            dim=1,
        )
        return fused.reshape(-1, *rest)

    def load_shard(self, reader, dims, padded_vocab, rank, size, out):
        """The rank's whole query groups: its rows of q, k and v, each written into its place in `out`."""
        groups, head_dim = dims.num_kv_heads, dims.head_dim
        q_rows = dims.num_heads // groups * head_dim
        rest = tuple(out.shape[1:])
        local = groups // size
        for name, rows in zip(self.hf, (q_rows, head_dim, head_dim)):
            _check_fits(self, reader.shape(name), (groups * rows, *rest))
        _check_fits(self, (local * (q_rows + 2 * head_dim), *rest), out.shape)
        grouped = out.view(local, q_rows + 2 * head_dim, *rest)
        first = rank * local
        for name, rows, part in zip(
            self.hf, (q_rows, head_dim, head_dim), grouped.split([q_rows, head_dim, head_dim], 1)
        ):
            part.copy_(reader.rows(name, first * rows, (first + local) * rows).view(local, rows, *rest))

    def to_hf(self, full, dims):
        groups, head_dim = dims.num_kv_heads, dims.head_dim
        q_per_group = dims.num_heads // groups
        rest = full.shape[1:]
        grouped = full.reshape(groups, (q_per_group + 2) * head_dim, *rest)
        q, k, v = grouped.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]

    def tp1_hf_rows(self, dims, rows, device):
        """Every query group's q rows, then every group's k rows, then its v rows."""
        q_rows = dims.num_heads // dims.num_kv_heads * dims.head_dim
        if not _uses(self, QKVMapping, *_TP1_RULES) or rows != dims.num_kv_heads * (q_rows + 2 * dims.head_dim):
            return None
        return _qkv_rows(dims.num_kv_heads, q_rows, dims.head_dim, torch.device(device))

    def unshard_to_hf(self, shards, dims, out):
        """q, k, v straight from the shards (whole query groups each), split per group in one pass."""
        groups, head_dim = dims.num_kv_heads, dims.head_dim
        q_rows = dims.num_heads // groups * head_dim
        rest = tuple(shards[0].shape[1:])
        q = _flat_view(out, 0, (groups, q_rows, *rest))
        k = _flat_view(out, q.numel(), (groups, head_dim, *rest))
        v = _flat_view(out, q.numel() + k.numel(), (groups, head_dim, *rest))
        start = 0
        for shard in shards:
            local = shard.reshape(-1, q_rows + 2 * head_dim, *rest)
            count = local.shape[0]
            for target, part in zip((q, k, v), local.split([q_rows, head_dim, head_dim], dim=1)):
                target[start : start + count].copy_(part)
            start += count
        if start != groups:
            raise ValueError(f"{self.mcore}: the shards hold {start} query groups, the model has {groups}")
        return [t.view(-1, *rest) for t in (q, k, v)]

    def shard_to_hf(self, shard, rank, size, dims, out):
        """This rank's whole query groups, into their rows of q, k and v."""
        groups, head_dim = dims.num_kv_heads, dims.head_dim
        q_rows = dims.num_heads // groups * head_dim
        rest = tuple(shard.shape[1:])
        local = shard.reshape(-1, q_rows + 2 * head_dim, *rest)
        if local.shape[0] * size != groups:
            raise ValueError(f"{self.mcore}: {size} shards of {local.shape[0]} query groups; the model has {groups}")
        start, offset = rank * local.shape[0], 0
        for rows, part in zip((q_rows, head_dim, head_dim), local.split([q_rows, head_dim, head_dim], dim=1)):
            target = _flat_view(out, offset, (groups, rows, *rest))
            target[start : start + local.shape[0]].copy_(part)
            offset += target.numel()

    @property
    def writes_shards(self) -> bool:
        return self.tp_dim == 0 and _uses(self, QKVMapping, "unshard", "to_hf", "unshard_to_hf", "shard_to_hf")


@dataclass(frozen=True)
class GateUpMapping(Mapping):
    """gate_proj and up_proj ↔ `linear_fc1` = [gate; up], where every TP shard is [gate_r; up_r]."""

    tp_dim: int | None = 0

    def to_mcore(self, hf_tensors, dims, padded_vocab):
        return torch.cat(list(hf_tensors), dim=0)

    def to_hf(self, full, dims):
        return list(full.chunk(2, dim=0))

    def load_shard(self, reader, dims, padded_vocab, rank, size, out):
        """[gate_r; up_r]: the rank's rows of gate_proj, then of up_proj."""
        half = out.shape[0] // 2
        for name, part in zip(self.hf, out.chunk(2, dim=0)):
            _check_fits(self, reader.shape(name), (half * size, *out.shape[1:]))
            part.copy_(reader.rows(name, rank * half, (rank + 1) * half))

    def shard(self, full, rank, size):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)

    def unshard(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)

    def tp1_hf_rows(self, dims, rows, device):
        """At TP1 `linear_fc1` is [gate; up]: the two HF tensors as they lie."""
        return range(rows) if _uses(self, GateUpMapping, *_TP1_RULES) else None

    def unshard_to_hf(self, shards, dims, out):
        """Every shard is [gate_r; up_r]: the gate halves, then the up halves, concatenated into `out`."""
        halves = [s.chunk(2, dim=0) for s in shards]
        full = _flat_view(out, 0, (sum(s.shape[0] for s in shards), *shards[0].shape[1:]))
        row = 0
        for half in [h[0] for h in halves] + [h[1] for h in halves]:  # copies, not cat(out=): see `writesums`
            full[row : row + half.shape[0]].copy_(half)
            row += half.shape[0]
        return list(full.chunk(2, dim=0))

    def shard_to_hf(self, shard, rank, size, dims, out):
        """[gate_r; up_r] into rows rank·half… of gate_proj and of up_proj."""
        half = shard.shape[0] // 2
        full = _flat_view(out, 0, (2 * half * size, *shard.shape[1:]))
        for target, part in zip(full.chunk(2, dim=0), shard.chunk(2, dim=0)):
            target[rank * half : (rank + 1) * half].copy_(part)

    @property
    def writes_shards(self) -> bool:
        return self.tp_dim == 0 and _uses(self, GateUpMapping, "unshard", "to_hf", "unshard_to_hf", "shard_to_hf")


_TP1_RULES = ("unshard", "to_hf", "unshard_to_hf")
"""What `tp1_hf_rows` stands for: a class that changes one of them loses the rows its parent derived."""


def _uses(mapping: Mapping, cls: type, *methods: str) -> bool:
    """Whether `mapping`'s class has `cls`'s own `methods` (a subclass that changes one of them
    loses the rules that `cls` derived from them)."""
    return all(getattr(type(mapping), m) is getattr(cls, m) for m in methods)


@functools.lru_cache(maxsize=32)
def _qkv_rows(groups: int, q_rows: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """`QKVMapping.tp1_hf_rows`: the fused tensor's row indices in q, k, v order (kept per device)."""
    grouped = torch.arange(groups * (q_rows + 2 * head_dim)).view(groups, -1)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)]).to(device)


def _check_fits(mapping: Mapping, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"{mapping.hf} → {mapping.mcore}: shape {tuple(shape)} does not fit the model's {tuple(expected)};"
            " does config.json match the weights?"
        )


def _flat_view(out: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """`out[offset:offset + numel]` viewed as `shape` (out is a flat, contiguous buffer)."""
    numel = torch.Size(shape).numel()
    if offset + numel > out.numel():
        raise ValueError(f"the output buffer holds {out.numel()} elements; {offset + numel} are needed")
    return out[offset : offset + numel].view(shape)


def write_flat(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> list[torch.Tensor]:
    """Copy `tensors` one after another into the flat buffer `out`; returns them as views of `out`."""
    views, offset = [], 0
    for tensor in tensors:
        view = _flat_view(out, offset, tensor.shape)
        view.copy_(tensor)
        views.append(view)
        offset += tensor.numel()
    return views
