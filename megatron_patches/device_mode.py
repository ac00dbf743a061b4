"""Patch 3 — hard-coded CUDA placement (`device="cuda"`, `.cuda()`, `pin_memory=True`) → CPU.

What: `CpuDeviceMode`, a `torch.overrides.TorchFunctionMode` that rewrites, for every torch call
  made while it is active on the current thread:
  * a `device=` keyword that names CUDA (`"cuda"`, `"cuda:N"`, `torch.device("cuda", N)`, or a
    bare accelerator index `N`) to `torch.device("cpu")` (factory functions such as `torch.empty`,
    `torch.zeros`, `torch.tensor`, `torch.empty_like`, `Tensor.new_*`, `Tensor.to(device=...)`);
  * `Tensor.cuda(...)` and `Tensor.to(<CUDA device>, ...)` to `Tensor.to("cpu", ...)`;
  * `pin_memory=True` to `pin_memory=False`, and `Tensor.pin_memory()` to the tensor itself
    (the "already pinned" result).
  Other patches add entries to `HANDLERS` (patch 4: `Tensor.record_stream`; patch 5:
  `Tensor.type`), so a single mode serves them all.
Why: megatron-core allocates many small buffers with a literal `device="cuda"` or `.cuda()`
  (megatron-core 0.19.2: pipeline_parallel/schedules.py `total_num_tokens`,
  optimizer/optimizer.py `found_inf` / `_dummy_overflow_buf` / `_scale_one` / `_scale`,
  `has_grad_norm_group`, optimizer/clip_grads.py `total_norm` / `dummy_overflow_buf`,
  utils.py `local_multi_tensor_l2_norm`, optimizer/grad_scaler.py,
  distributed/param_and_grad_buffer.py `tmp_warmup_tensor` and `.pin_memory()`,
  dist_checkpointing/exchange_utils.py `empty_like(device="cuda")` / `.cuda()`,
  dist_checkpointing/strategies/state_dict_saver.py, transformer/utils.py attention masks,
  models/common/embeddings/rope_utils.py `pin_memory=True`, tensor_parallel/data.py, utils.py).
  A CPU-only torch raises on each of them. Rewriting the call sites one by one would mean copying
  dozens of megatron functions; a function mode rewrites only the placement argument.
Why the math is unchanged: only where a tensor lives changes — never its dtype, shape, values or
  the operation applied. `pin_memory` only affects host→device copy speed; there is no device.
  The mode is thread-local: push it on every thread that runs megatron code (`cpu_device_mode()`);
  autograd's CPU backward runs on the calling thread, so it is covered.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21.
Removable when: megatron-core takes the device from a config/argument everywhere (it already does
  for most parameters via `torch.cuda.current_device()`, see patch 2), or torch's
  `torch.accelerator` API is used throughout so that a CPU "accelerator" works natively.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")

# func -> handler(func, args, kwargs). Patches 4 and 5 register here while applied.
HANDLERS: Dict[Callable, Callable[[Callable, tuple, dict], Any]] = {}


def is_cuda_device(device: Any) -> bool:
    """True for the ways megatron names a CUDA device: "cuda", "cuda:N", torch.device, index N."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_kwargs(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and is_cuda_device(device):
        kwargs = {**kwargs, "device": CPU}
    if kwargs.get("pin_memory"):
        kwargs = {**kwargs, "pin_memory": False}
    return kwargs


def _tensor_cuda(func, args, kwargs):
    # Tensor.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)
    tensor = args[0]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    return tensor.to(CPU, non_blocking=non_blocking, memory_format=memory_format)


def _tensor_to(func, args, kwargs):
    if len(args) > 1 and is_cuda_device(args[1]):
        args = (args[0], CPU) + tuple(args[2:])
    return func(*args, **_cpu_kwargs(kwargs))


def _tensor_pin_memory(func, args, kwargs):
    return args[0]


HANDLERS[torch.Tensor.cuda] = _tensor_cuda
HANDLERS[torch.Tensor.to] = _tensor_to
HANDLERS[torch.Tensor.pin_memory] = _tensor_pin_memory


class CpuDeviceMode(TorchFunctionMode):
    """Maps CUDA placement to CPU for torch calls made on this thread while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if kwargs:
            kwargs = _cpu_kwargs(kwargs)
        return func(*args, **kwargs)


def mode_active_on_this_thread() -> bool:
    """Whether a CpuDeviceMode is on this thread's torch-function mode stack."""
    stack = torch.overrides._get_current_function_mode_stack()
    return any(isinstance(mode, CpuDeviceMode) for mode in stack)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Context manager: CUDA placement → CPU on this thread.

    A no-op when CUDA is available (a GPU machine must never be silently moved to CPU) or when the
    mode is already active on this thread.
    """
    if torch.cuda.is_available() or mode_active_on_this_thread():
        yield
        return
    with CpuDeviceMode():
        yield


@contextlib.contextmanager
def device_mode_suspended() -> Iterator[None]:
    """Context manager: this thread's device mode off for a block that runs no megatron code (code that
    places its tensors itself), so its torch calls skip the mode's Python hook (a few µs each). A no-op
    when the mode is not the top of this thread's torch-function mode stack (another mode above it
    stays, and so does the device mode under it)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], CpuDeviceMode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield
