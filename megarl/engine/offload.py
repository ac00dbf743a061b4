"""Offload a role's parameters, gradients and optimizer state to host memory and back.

Owns: `model_and_optimizer_tensors` (every tensor whose storage a training engine holds) and
`offload` / `onload`. Works at the storage level: each distinct storage (DDP's flat parameter and
gradient buffers, Adam's moments, fp32 main parameters) is copied once to a host buffer (pinned
on GPU) and resized to 0 bytes, so every view (param.data, param.main_grad, optimizer shards)
stays a valid tensor object and comes back bit for bit. Nothing the model or the optimizer owns
keeps device memory while offloaded. On CPU the same path runs (the copy is host-to-host), so it
is tested without a GPU.

Imports only torch.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def model_and_optimizer_tensors(model_chunks, optimizer=None) -> list[torch.Tensor]:
    """Parameters, their main grads / grads, and every tensor in the optimizer's state."""
    tensors = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            tensors += [t for t in (param, getattr(param, "main_grad", None), param.grad) if t is not None]
        for buffer in _ddp_buffers(chunk):
            tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                tensors += [t for t in (param, param.grad) if t is not None]
        for state in inner.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    return tensors


def _ddp_buffers(chunk) -> list:
    """megatron DDP's flat parameter/gradient buffers (its `buffers` attribute shadows Module.buffers)."""
    buffers = getattr(chunk, "buffers", None)
    return buffers + list(getattr(chunk, "expert_parallel_buffers", [])) if isinstance(buffers, list) else []


def inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (chained / distributed / mixed-precision) wrappers."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for chained in optimizer.chained_optimizers for o in inner_optimizers(chained)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


class Offloaded:
    """Host copies of offloaded storages, to restore them with `onload`."""

    def __init__(self):
        self.entries: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def bytes(self) -> int:
        return sum(host.numel() for _, host in self.entries)


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


def offload(tensors: Iterable[torch.Tensor], pin: Optional[bool] = None) -> Offloaded:
    """Copy each distinct storage to host memory and free it (resize to 0)."""
    pin = torch.cuda.is_available() if pin is None else pin
    saved = Offloaded()
    for storage in _storages(tensors):
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        host.untyped_storage().copy_(storage)
        storage.resize_(0)
        saved.entries.append((storage, host))
    return saved


def onload(saved: Offloaded) -> None:
    """Reallocate every offloaded storage on its device and copy its bytes back."""
    for storage, host in saved.entries:
        storage.resize_(host.numel())
        storage.copy_(host.untyped_storage())
    saved.entries.clear()


def device_bytes(tensors: Iterable[torch.Tensor], device_type: str = "cuda") -> int:
    """Bytes of distinct storages of `tensors` that still live on `device_type`."""
    return sum(s.nbytes() for s in _storages(tensors) if s.device.type == device_type)
