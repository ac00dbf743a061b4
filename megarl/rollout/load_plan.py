"""Replaying a model's weight loaders: the copies they made for one update, made again for the next.

Owns: `ReplayingLoader`. A vLLM CPU engine with plain weights (`vllm_patches.loads_in_place`) takes an
update through the model's own `load_weights`: per tensor, Python that maps the HF name to a
parameter, picks the shard (q/k/v of a fused qkv, gate/up, the TP slice) and ends in one
`param_slice.copy_(tensor_slice)`. For a small model that Python is most of a sync's CPU in the engine
(~1.5 of ~2 ms in the quickstart's engine core), and every sync of a run sends the same tensors. So:

1. **Record** (an update whose tensors have no plan): the real loader runs under a torch-function mode that
   notes every `copy_` from a slice of an update tensor into a slice of a parameter — which tensor, where
   in it (offset, sizes, strides) and the parameter slice. A copy from anything else (a tensor the loader
   computed) or into anything else, or any other write into a parameter's memory (an in-place op, an
   indexed assignment, `out=`) but a fill with a constant, means the loader does more than copy: no plan,
   for good.
2. **Validate** (the next update with the same tensors — names, shapes and dtypes, in order): the plan is
   replayed, every parameter's bytes are hashed (blake2b: position-sensitive, no copy of the model), the
   real loader runs again on the same tensors, and the plan is kept only if it changed no hash and gave no
   parameter new memory — a second check, on data the recording never saw, of what recording cannot see
   (a parameter the loader re-binds). Constant fills (vocabulary padding rows) are the same either way.
3. **Replay** (every later update with those tensors): the noted copies only, tensor by tensor as the
   buckets arrive. An update with other tensors stops replaying at the first one that differs and hands
   the whole update to the real loader (some loaders refuse a tensor without its companions, e.g. a tied
   `lm_head` without the embedding); the next update records afresh, as it does after a failed one.
4. **Adopt** (`adopt()`, after an update replayed whole from buffers its sender keeps for this engine alone,
   `ipc.IpcSender(adopt=True)`): a parameter that whole copies of consecutive update tensors tile, in
   order, from tensors lying next to each other in one buffer (q, k, v → qkv; gate, up → gate_up; any
   weight alone) becomes a view of that memory. The trainer's ranks then write later updates straight into
   the model, and a replayed tensor already in place is only checked. At rollout TP > 1 the copies are
   slices: nothing is adopted. Any load but a replay first gives adopted parameters memory of their own
   again (`release`: its sources may be the buffers they live in); so does a replayed tensor that goes
   into an adopted parameter but arrives elsewhere (the replay then goes on, its copies re-aimed).

Integrity (`load_checked`): tensors may come with their sender's checksum still to check
(`protocol.PendingCheck`). A replayed copy of a whole tensor into one contiguous parameter slice of its
dtype copies and sums it in one pass (`PendingCheck.copy_into`) and then compares, so the check costs no
second read of the bytes (a mismatch is found with the tensor in the model: the update fails as one that
had begun loading); every other copy, and the real loader, get each tensor only once its check has passed.

Only the in-place CPU path uses it (`sharding.ipc.MegarlWorkerExtension`); the reload path (GPU, packed
kernels, MoE) keeps vLLM's `reload_weights`. Imports torch and `sharding.protocol`.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megarl.rollout.sharding.protocol import PendingCheck

Weights = Iterable[tuple[str, torch.Tensor]]
Checked = tuple[str, torch.Tensor, Optional[PendingCheck]]  # a tensor and its checksum check still to pass


@dataclass(frozen=True)
class _Copy:
    """One recorded copy: `dst.copy_(tensor.as_strided(size, stride, tensor's offset + offset))`."""

    dst: torch.Tensor  # a view of a parameter
    offset: int  # elements from the update tensor's first element
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Plan:
    signature: list[tuple[str, tuple[int, ...], torch.dtype]]  # the update's tensors, in order
    copies: list[list[_Copy]]  # per tensor
    storages: dict[str, int]  # parameters written → their data_ptr
    validated: bool = False

    def matches(self, index: int, name: str, tensor: torch.Tensor) -> bool:
        return index < len(self.signature) and self.signature[index] == (name, tuple(tensor.shape), tensor.dtype)

    def replay(self, index: int, tensor: torch.Tensor, check: Optional[PendingCheck] = None) -> None:
        """The tensor's recorded copies; with its `check`, in one pass that also sums it (`copysum`) where
        the tensor goes whole into one contiguous parameter slice of its dtype, else checked first."""
        copies = self.copies[index]
        whole = len(copies) == 1 and _whole(copies[0], tensor)
        if whole and copies[0].dst.data_ptr() == tensor.data_ptr():
            if check is not None:  # an adopted parameter (`ReplayingLoader.adopt`): the bytes are in it already
                check.check_in_place()
            return
        if whole and check is not None:
            check.copy_into(copies[0].dst)
            return
        if check is not None:
            check.check()
        base = tensor.storage_offset()
        for c in copies:
            c.dst.copy_(tensor.as_strided(c.size, c.stride, base + c.offset))

    def intact(self, parameters: dict[str, torch.Tensor]) -> bool:
        """Every parameter the plan writes is still the model's, in the memory it was recorded in."""
        return all(name in parameters and parameters[name].data_ptr() == ptr for name, ptr in self.storages.items())


class ReplayingLoader:
    """`load(model_loader, weights)`: an update through the model's loader, or the copies it made before."""

    def __init__(self, parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]]):
        self._parameters = parameters  # the model's named parameters (snapshot and storage checks)
        self._plan: Optional[_Plan] = None
        self.disabled = False  # the loader did more than copy: always the real loader
        self.replayed = 0  # tensors loaded by replay (tests, logs)
        self.adopted: set[str] = set()  # parameters that are views of the sender's buffers (`adopt`)
        self._adopted_storages: set[int] = set()  # the buffers they live in
        self._replayed: Optional[list[torch.Tensor]] = None  # the last update's tensors, if it was replayed whole

    def load(self, model_loader: Callable[[Weights], object], weights: Weights) -> None:
        self.load_checked(model_loader, ((name, tensor, None) for name, tensor in weights))

    def load_checked(self, model_loader: Callable[[Weights], object], items: Iterable[Checked]) -> None:
        """`load` of (name, tensor, its pending checksum check or None): a replay checks each tensor as it
        copies it (`_Plan.replay`); the model's loader gets each tensor once it is checked."""
        plan, self._plan, self._replayed = self._plan, None, None
        if self.adopted and not (plan is not None and plan.validated and not self.disabled):
            self.release()  # the model's loader may read the buffers the adopted parameters live in
        if self.disabled:
            model_loader(_checked_first(items))
        elif plan is None:
            self._plan = self._record(model_loader, _checked_first(items))
        elif not plan.intact(dict(self._parameters())):
            self.disabled = True
            self.release()
            model_loader(_checked_first(items))
        elif plan.validated:
            self._replay(plan, model_loader, items)
        else:
            self._validate(plan, model_loader, _checked_first(items))

    def adopt(self) -> int:
        """After an update replayed whole from buffers its sender keeps for this engine alone, from update to
        update: every parameter that whole copies of consecutive update tensors tile, in order, and whose
        tensors lie next to each other in one buffer becomes a view of that memory (q, k, v into a fused qkv;
        gate, up into gate_up; every other weight alone). Later updates are written there by the trainer's
        ranks: `_Plan.replay` then only checks them. Returns the parameter bytes adopted now."""
        plan, views = self._plan, self._replayed
        if plan is None or views is None or self.disabled:
            return 0
        params = dict(self._parameters())
        owner = {p.untyped_storage().data_ptr(): n for n, p in params.items() if n not in self.adopted}
        groups: dict[str, list[int]] = {}
        mixed = set()  # parameters some other copy writes into too (a slice, a second source)
        for index, copies in enumerate(plan.copies):
            names = {owner.get(c.dst.untyped_storage().data_ptr()) for c in copies}
            if len(copies) == 1 and _whole(copies[0], views[index]):
                groups.setdefault(names.pop(), []).append(index)
            else:
                mixed |= names
        groups = {n: i for n, i in groups.items() if n is not None and n not in mixed}  # adopted ones: no owner
        adopted = 0
        for name, indices in groups.items():
            region = _tiling_region(params[name], [plan.copies[i][0] for i in indices], [views[i] for i in indices])
            if region is not None:
                adopted += _rebind(plan, name, params[name], region, indices)
                self.adopted.add(name)
                self._adopted_storages.add(region.untyped_storage().data_ptr())
        return adopted

    def _displaced(self, plan: _Plan, index: int, tensor: torch.Tensor) -> bool:
        """Whether the tensor goes into an adopted parameter but does not arrive where that parameter lives."""
        if not self.adopted:
            return False
        copies = plan.copies[index]
        adopted = any(c.dst.untyped_storage().data_ptr() in self._adopted_storages for c in copies)
        return adopted and not (len(copies) == 1 and copies[0].dst.data_ptr() == tensor.data_ptr())

    def release(self, plan: Optional[_Plan] = None) -> None:
        """Adopted parameters get memory of their own again (before any load but a replay: its sources may be
        the buffers they live in); `plan`'s copies into them are re-aimed at it."""
        params = dict(self._parameters())
        for name in self.adopted:
            if name in params:
                param = params[name]
                old, indices = param.data_ptr(), [] if plan is None else _copies_into(plan, param)
                param.data = param.data.clone()
                if plan is not None:
                    _reaim(plan, name, param, old, indices)
        self.adopted.clear()
        self._adopted_storages.clear()

    # -- the three steps ------------------------------------------------------------------------
    def _record(self, model_loader, weights: Weights) -> Optional[_Plan]:
        recorder = _Recorder({p.untyped_storage().data_ptr(): (n, p) for n, p in self._parameters()})
        with recorder:
            model_loader(recorder.feed(weights))
        if recorder.failed:
            self.disabled = True
            return None
        return recorder.plan()

    def _replay(self, plan: _Plan, model_loader, items: Iterable[Checked]) -> None:
        rest, done = iter(items), []  # done: views of the update's buckets, valid until it ends
        for index, (name, tensor, check) in enumerate(rest):
            if not plan.matches(index, name, tensor):  # other tensors: the real loader takes the whole update
                self.release()
                model_loader(itertools.chain(done, _checked_first(itertools.chain([(name, tensor, check)], rest))))
                return
            if self._displaced(plan, index, tensor):  # copying it into the buffers could overwrite a later
                self.release(plan)  # tensor's bytes: the parameters get memory of their own, the replay goes on
            plan.replay(index, tensor, check)
            done.append((name, tensor))
        self.replayed += len(done)
        self._plan = plan  # a whole update, or a prefix of one: the plan stands
        if len(done) == len(plan.signature):
            self._replayed = [tensor for _, tensor in done]

    def _validate(self, plan: _Plan, model_loader, weights: Weights) -> None:
        taken = list(weights)  # views of the update's buckets, valid until the update ends
        if [(n, tuple(t.shape), t.dtype) for n, t in taken] != plan.signature:
            model_loader(iter(taken))  # other tensors than recorded: loaded for real, recorded next time
            return
        for index, (_, tensor) in enumerate(taken):
            plan.replay(index, tensor)
        before = _fingerprint(self._parameters())
        model_loader(iter(taken))
        if _fingerprint(self._parameters()) == before:
            plan.validated = True
            self._plan = plan
        else:
            self.disabled = True


def _checked_first(items: Iterable[Checked]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each item, its pending check (if any) passed before it is handed on."""
    for name, tensor, check in items:
        if check is not None:
            check.check()
        yield name, tensor


def _whole(copy: _Copy, tensor: torch.Tensor) -> bool:
    """Whether the copy takes the whole (contiguous) tensor into a contiguous slice of the same dtype: a
    byte-for-byte copy."""
    dst = copy.dst
    return (
        copy.offset == 0
        and copy.size == tuple(tensor.shape)
        and copy.stride == tuple(tensor.stride())
        and tensor.is_contiguous()
        and dst.is_contiguous()
        and dst.dtype == tensor.dtype
        and dst.numel() == tensor.numel()
        and dst.device.type == "cpu"
    )


def _tiling_region(param: torch.Tensor, copies: list, views: list) -> Optional[torch.Tensor]:
    """The memory of `views` as one flat tensor, where the copies fill `param` whole, in order, from views
    that follow each other in one buffer; else None."""
    order = sorted(range(len(copies)), key=lambda k: copies[k].dst.data_ptr())
    if order != list(range(len(copies))) or not param.is_contiguous():
        return None
    at, source = param.data_ptr(), views[0]
    for copy, view in zip(copies, views):
        adjacent = view.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() and view.data_ptr() == (
            source.data_ptr() + (at - param.data_ptr())
        )
        if copy.dst.data_ptr() != at or not adjacent or view.dtype != param.dtype:
            return None
        at += copy.dst.numel() * copy.dst.element_size()
    if at != param.data_ptr() + param.numel() * param.element_size():
        return None
    return torch.empty(0, dtype=param.dtype).set_(source.untyped_storage(), source.storage_offset(), (param.numel(),))


def _rebind(plan: _Plan, name: str, param: torch.Tensor, region: torch.Tensor, indices: list[int]) -> int:
    """`param` becomes `region` (its shape); the plan's copies into it are re-aimed at the new memory."""
    old = param.data_ptr()
    param.data = region.view(param.shape)
    _reaim(plan, name, param, old, indices)
    return param.numel() * param.element_size()


def _copies_into(plan: _Plan, param: torch.Tensor) -> list[int]:
    """The update tensors whose (single) copy goes into `param`'s memory (adopted parameters share a buffer)."""
    start = param.data_ptr()
    end = start + param.numel() * param.element_size()
    return [i for i, copies in enumerate(plan.copies) if len(copies) == 1 and start <= copies[0].dst.data_ptr() < end]


def _reaim(plan: _Plan, name: str, param: torch.Tensor, old: int, indices: list[int]) -> None:
    """The plan's copies of `indices`, which went into `param` when it lived at `old`, now go to its memory."""
    flat = param.data.view(-1)
    for index in indices:
        copy = plan.copies[index][0]
        start = (copy.dst.data_ptr() - old) // param.element_size()
        dst = flat[start : start + copy.dst.numel()].view(copy.dst.shape)
        plan.copies[index] = [_Copy(dst, copy.offset, copy.size, copy.stride)]
    plan.storages[name] = param.data_ptr()


def _fingerprint(parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, bytes]]:
    """Per parameter: where its memory is, and a hash of its bytes in order (CPU parameters)."""
    out = {}
    for name, param in parameters:
        raw = param.detach().contiguous().reshape(-1).view(torch.uint8)
        out[name] = (param.data_ptr(), hashlib.blake2b(raw.numpy(), digest_size=16).digest())
    return out


_IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
}


def writes_into(func, args, kwargs, storages) -> bool:
    """Whether the call writes into the memory of a storage whose data pointer is in `storages` (a parameter's,
    here; a weight bucket's, `writesums`): an in-place method (`mul_`, `__setitem__`, ...) on it, an in-place
    `torch._foreach_*_` on a list holding it, or an `out=`."""
    name = getattr(func, "__name__", "")
    if name.startswith("_foreach_") and name.endswith("_") and args:
        targets = list(args[0])
    else:
        in_place = (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_DUNDERS
        targets = [args[0]] if in_place and args else []
    out = kwargs.get("out")
    targets += list(out) if isinstance(out, (tuple, list)) else [out]
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages for t in targets)


def _constant_fill(func, args) -> bool:
    """`fill_` with a number, or `zero_`: the same values whatever the update holds."""
    return func is torch.Tensor.zero_ or (func is torch.Tensor.fill_ and not isinstance(args[1], torch.Tensor))


class _Recorder(TorchFunctionMode):
    """Notes each `copy_` from a slice of a fed tensor into a slice of a parameter, while a loader runs."""

    def __init__(self, params_by_storage: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        self._params = params_by_storage
        self._fed: list[tuple[str, torch.Tensor]] = []
        self._copies: list[list[_Copy]] = []
        self.failed = False

    def feed(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self._fed.append((name, tensor))
            self._copies.append([])
            yield name, tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.failed:
            if func is torch.Tensor.copy_:
                self._note(args[0], args[1])
            elif writes_into(func, args, kwargs, self._params) and not _constant_fill(func, args):
                self.failed = True  # a write into a parameter the plan could not replay
        return func(*args, **kwargs)

    def _note(self, dst: torch.Tensor, src) -> None:
        source = self._source(src) if isinstance(src, torch.Tensor) else None
        if source is None or dst.untyped_storage().data_ptr() not in self._params:
            self.failed = True  # a copy of something computed, or into something else: not a plain copy
            return
        index, tensor = source
        self._copies[index].append(
            _Copy(dst, src.storage_offset() - tensor.storage_offset(), tuple(src.shape), tuple(src.stride()))
        )

    def _source(self, src: torch.Tensor) -> Optional[tuple[int, torch.Tensor]]:
        """(index, fed tensor) whose elements `src` views (same memory and dtype)."""
        ptr = src.untyped_storage().data_ptr()
        for index in range(len(self._fed) - 1, -1, -1):  # the loader works on the latest tensors
            tensor = self._fed[index][1]
            if tensor.untyped_storage().data_ptr() != ptr or tensor.dtype != src.dtype:
                continue
            start = tensor.storage_offset()
            if start <= src.storage_offset() < start + max(tensor.numel(), 1):
                return index, tensor
        return None

    def plan(self) -> _Plan:
        signature = [(n, tuple(t.shape), t.dtype) for n, t in self._fed]
        written = (self._params[c.dst.untyped_storage().data_ptr()] for copies in self._copies for c in copies)
        return _Plan(signature, self._copies, {name: param.data_ptr() for name, param in written})
