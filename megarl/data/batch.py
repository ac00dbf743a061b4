"""The one batch type that crosses between roles: named tensors with a shared first dimension
(rows), non-tensor columns (numpy arrays, same rows) and a free-form `meta` dict.

A batch may carry a `Schema` (`megarl.data.schema`: the declared columns, their kinds and shapes);
then every column written into it is checked against the schema, and batches derived from it
(rows, selections, unions, concatenations, after pickling) keep it. The RL loop's batches carry
`schema.ROLLOUT`; a batch without a schema takes any column (tests, tools, worker results).

Operations return new batches that share tensor storage where they can (select, slicing, split);
only `pop` and item assignment change a batch in place. Pickling turns each tensor into a numpy
array over the same bytes, so pickle protocol 5 (Ray) ships them as out-of-band buffers without
copies or per-row Python objects.

Imports only torch and numpy (no megatron, vLLM or Ray).
"""

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from megarl.data.schema import Schema

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]

# torch dtypes numpy cannot hold travel as same-width integers and are viewed back on arrival.
_NUMPY_STANDIN = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Batch:
    """Columns keyed by name, every one with the same number of rows.

    tensors: name → torch.Tensor [rows, ...];  non_tensors: name → np.ndarray [rows, ...]
    (object dtype for Python values);  meta: anything that is not per row.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray] | None = None,
        meta: dict[str, Any] | None = None,
        rows: int | None = None,
        schema: Schema | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        self.schema = schema
        self._rows = rows
        for key, value in (tensors or {}).items():
            self[key] = value
        for key, value in (non_tensors or {}).items():
            self[key] = _as_column(value)
        if self._rows is None:
            self._rows = 0

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor],
        non_tensors: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
        schema: Schema | None = None,
    ) -> "Batch":
        """A batch from tensors, non-tensor columns (lists or arrays; lists become object arrays) and meta."""
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensor column {key!r} is a {type(value).__name__}; pass it in non_tensors")
        return cls(tensors, non_tensors, meta, schema=schema)

    # ---- columns -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._rows

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        """Column names: tensor columns, then non-tensor columns."""
        return [*self.tensors, *self.non_tensors]

    def __getitem__(self, index: "str | Index"):
        """`batch["name"]` → that column; any other index → a Batch of the selected rows.

        Row indices: int (a one-row batch), slice (views), int tensor/array/list, bool mask.
        """
        if isinstance(index, str):
            return self._column(index)
        return self._take(_normalize_index(index, self._rows))

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence) -> None:
        """Add or replace a column; tensors go to `tensors`, anything else to `non_tensors`."""
        column = value if isinstance(value, torch.Tensor) else _as_column(value)
        if column.ndim == 0:
            raise ValueError(f"column {key!r} is 0-dimensional; per-batch values belong in meta")
        if self.schema is not None:
            self.schema.check(key, column)
        if self._rows is None or (self._rows == 0 and not self.keys()):
            self._rows = column.shape[0]
        if column.shape[0] != self._rows:
            raise ValueError(f"column {key!r} has {column.shape[0]} rows; the batch has {self._rows}")
        is_tensor = isinstance(column, torch.Tensor)
        home, other = (self.tensors, self.non_tensors) if is_tensor else (self.non_tensors, self.tensors)
        other.pop(key, None)
        home[key] = column  # replacing keeps the column's position

    def select(self, *keys: str) -> "Batch":
        """A batch with only `keys` (sharing their storage) and a copy of meta."""
        return self._with([(key, self._column(key)) for key in keys])

    def pop(self, *keys: str) -> "Batch":
        """Remove `keys` from this batch and return them as a new batch (with a copy of meta)."""
        popped = self.select(*keys)
        for key in keys:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
        return popped

    def union(self, other: "Batch") -> "Batch":
        """Columns and meta of both. Rows must match; a key in both must hold equal data."""
        if len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for key in other.keys():
            if key in self and not _same(self._column(key), other._column(key)):
                raise ValueError(f"cannot union: column {key!r} differs between the two batches")
        for key in other.meta.keys() & self.meta.keys():
            if not _same(self.meta[key], other.meta[key]):
                raise ValueError(f"cannot union: meta {key!r} differs between the two batches")
        merged = self._with([(key, self._column(key)) for key in self.keys()])
        for key in other.keys():
            merged[key] = other._column(key)
        merged.meta.update(other.meta)
        return merged

    # ---- rows --------------------------------------------------------------------------------

    def repeat(self, n: int, interleave: bool = True) -> "Batch":
        """Each row n times: interleaved, row i → rows i·n … i·n+n−1; else the whole batch n times."""
        if interleave:
            tensors = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            arrays = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensors.items()}
        else:
            tensors = {k: v.repeat(n, *([1] * (v.ndim - 1))) for k, v in self.tensors.items()}
            arrays = {k: np.tile(v, (n,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensors.items()}
        return Batch(tensors, arrays, self.meta, rows=len(self) * n, schema=self.schema)

    def split(self, size: int) -> list["Batch"]:
        """Consecutive batches of `size` rows (the last may be smaller); views, no copies."""
        if size < 1:
            raise ValueError(f"split size must be >= 1; got {size}")
        return [self[start : start + size] for start in range(0, len(self), size)]

    def chunk(self, k: int) -> list["Batch"]:
        """Exactly k consecutive batches whose sizes differ by at most one (first ones larger)."""
        if k < 1:
            raise ValueError(f"chunk count must be >= 1; got {k}")
        bounds = np.cumsum([0] + [len(self) // k + (i < len(self) % k) for i in range(k)])
        return [self[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order; meta from the first. Keys, dtypes and trailing shapes must match."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            _check_compatible(first, batch, i)
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        arrays = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, arrays, first.meta, rows=sum(len(b) for b in batches), schema=first.schema)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The batch with every tensor on `device` (non-tensor columns and meta are shared)."""
        tensors = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return Batch(tensors, self.non_tensors, self.meta, rows=len(self), schema=self.schema)

    # ---- pickling (Ray) ----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """Tensors as numpy arrays over the same bytes (detached, on CPU, contiguous)."""
        return {
            "tensors": {k: _to_numpy(v) for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
            "rows": self._rows,
            "schema": self.schema,
        }

    def __setstate__(self, state: dict) -> None:
        self.tensors = {k: _from_numpy(*v) for k, v in state["tensors"].items()}
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]
        self._rows = state["rows"]
        self.schema = state.get("schema")

    def __repr__(self) -> str:
        cols = [f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for k, v in self.tensors.items()]
        cols += [f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.non_tensors.items()]
        return f"Batch(rows={len(self)}, {{{', '.join(cols)}}}, meta={sorted(self.meta)})"

    # ---- helpers -----------------------------------------------------------------------------

    def _column(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"no column {key!r}; columns: {', '.join(self.keys()) or '(none)'}")

    def _with(self, columns: Iterable[tuple[str, Any]], rows: int | None = None) -> "Batch":
        batch = Batch(meta=self.meta, rows=len(self) if rows is None else rows, schema=self.schema)
        for key, value in columns:
            (batch.tensors if isinstance(value, torch.Tensor) else batch.non_tensors)[key] = value
        return batch

    def _take(self, index: slice | np.ndarray) -> "Batch":
        rows = len(range(*index.indices(len(self)))) if isinstance(index, slice) else len(index)
        columns = [
            (k, v[index] if isinstance(index, slice) else v[torch.as_tensor(index, device=v.device)])
            for k, v in self.tensors.items()
        ]
        columns += [(k, v[index]) for k, v in self.non_tensors.items()]
        return self._with(columns, rows)


def _as_column(value: Any) -> np.ndarray:
    """A non-tensor column as a numpy array; lists and tuples become 1-D object arrays."""
    if isinstance(value, np.ndarray):
        return value
    column = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):  # element-wise: nested lists stay one object per row
        column[i] = item
    return column


def _normalize_index(index: Index, rows: int) -> slice | np.ndarray:
    """Row index → a slice or an int64 array of row numbers (negative ints wrapped, bounds checked)."""
    if isinstance(index, (int, np.integer)):
        if not -rows <= index < rows:
            raise IndexError(f"row {index} out of range for a batch of {rows} rows")
        index = int(index) % rows
        return slice(index, index + 1)
    if isinstance(index, slice):
        return index
    array = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if array.dtype == bool:
        if array.shape != (rows,):
            raise IndexError(f"bool mask has shape {array.shape}; the batch has {rows} rows")
        return np.flatnonzero(array)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise IndexError(f"rows must be indexed by ints, slices or bool masks; got {array.dtype}")
    array = array.astype(np.int64).reshape(-1)
    if array.size and (array.max() >= rows or array.min() < -rows):
        raise IndexError(f"row index out of range for a batch of {rows} rows")
    return array % max(rows, 1)


def _same(a: Any, b: Any) -> bool:
    """True when a and b hold equal data (tensors, arrays or plain values)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    try:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(np.array_equal(a, b))
        return bool(a == b)
    except (ValueError, TypeError):
        return False


def _check_compatible(first: Batch, other: Batch, i: int) -> None:
    """Raise naming the key when batch `i` cannot be concatenated after `first`."""
    pairs = (("tensor", first.tensors, other.tensors), ("non-tensor", first.non_tensors, other.non_tensors))
    for kind, a, b in pairs:
        for key in a.keys() ^ b.keys():
            where = "batch 0" if key in a else f"batch {i}"
            raise ValueError(f"cannot concat: {kind} column {key!r} is only in {where}")
        for key in a:
            if a[key].dtype != b[key].dtype:
                raise ValueError(
                    f"cannot concat: column {key!r} is {a[key].dtype} in batch 0 but {b[key].dtype} in batch {i}"
                )
            if tuple(a[key].shape[1:]) != tuple(b[key].shape[1:]):
                raise ValueError(
                    f"cannot concat: column {key!r} has trailing shape "
                    f"{tuple(a[key].shape[1:])} in batch 0 but {tuple(b[key].shape[1:])} in batch {i}"
                )


def _to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """(array over the tensor's bytes, original dtype name when numpy cannot hold it)."""
    tensor = tensor.detach().cpu().contiguous()
    try:
        return tensor.numpy(), None
    except TypeError:  # bfloat16, float8, ...: ship the bytes as a same-width integer
        standin = _NUMPY_STANDIN[tensor.element_size()]
        return tensor.view(standin).numpy(), str(tensor.dtype).removeprefix("torch.")


def _from_numpy(array: np.ndarray, dtype_name: str | None) -> torch.Tensor:
    """Tensor over the array's buffer (copied only when the buffer is read-only)."""
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(getattr(torch, dtype_name)) if dtype_name else tensor
