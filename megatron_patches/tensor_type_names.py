"""Patch 5 — report CPU tensor types under their CUDA names (`Tensor.type()`).

What: while the device mode (patch 3) is active, `tensor.type()` with no argument returns the
  CUDA legacy type name of a dense CPU tensor ("torch.FloatTensor" → "torch.cuda.FloatTensor");
  `tensor.type(<CUDA type or name>)` converts to the matching CPU type.
Why: megatron-core checks parameter and gradient types by their CUDA names (megatron-core 0.19.2:
  optimizer/clip_grads.py `assert param.grad.type() == 'torch.cuda.FloatTensor'`,
  optimizer/optimizer.py and optimizer/distrib_optimizer.py, which pick fp32 main params or raise
  "Wrapped parameters must be one of torch.cuda.FloatTensor, ..." for anything else).
Why the math is unchanged: only the reported name changes; dtypes and values are untouched, and
  the branch megatron takes is the one it takes for the same dtype on a GPU.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21.
Removable when: megatron-core checks `tensor.dtype` instead of `tensor.type()` strings.
"""

from __future__ import annotations

import torch

from megatron_patches import device_mode


def _cuda_name(name: str) -> str:
    if name.startswith("torch.") and not name.startswith(("torch.cuda.", "torch.sparse.")):
        return "torch.cuda." + name[len("torch.") :]
    return name


def _cpu_type(t):
    if isinstance(t, str) and t.startswith("torch.cuda."):
        return "torch." + t[len("torch.cuda.") :]
    if isinstance(t, type) and t.__module__ == "torch.cuda" and hasattr(torch, t.__name__):
        return getattr(torch, t.__name__)
    return t


def _tensor_type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        result = func(*args)
        return _cuda_name(result) if args[0].device.type == "cpu" else result
    if len(args) > 1:
        args = (args[0], _cpu_type(args[1])) + tuple(args[2:])
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": _cpu_type(kwargs["dtype"])}
    return func(*args, **kwargs)


def apply() -> None:
    device_mode.HANDLERS[torch.Tensor.type] = _tensor_type


def remove() -> None:
    device_mode.HANDLERS.pop(torch.Tensor.type, None)
