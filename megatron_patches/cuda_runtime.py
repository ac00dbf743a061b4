"""Patch 4 — CUDA runtime calls (streams, events, sync, memory stats, NVTX, device queries) → CPU.

What: while applied, these `torch.cuda` attributes are replaced:
  * `synchronize`, `set_device`, `set_stream`, `reset_peak_memory_stats`,
    `reset_max_memory_allocated`, `nvtx.range_push/range_pop/range_start/range_end/mark` → no-ops;
    `nvtx.range` → a null context;
  * `Stream`, `current_stream`, `default_stream` → a CPU stream object whose `wait_stream`,
    `wait_event`, `synchronize` are no-ops and `query()` is True; `stream(s)` and `device(i)` →
    null contexts;
  * `Event` → a CPU event: `record()` stores `time.perf_counter()`, `elapsed_time()` returns
    milliseconds between two records, `wait`/`synchronize` are no-ops, `query()` is True;
  * `is_current_stream_capturing` → False; `get_device_capability` → (0, 0);
    `get_device_name` → "cpu"; `get_device_properties` → CPU values (name "cpu", total_memory =
    physical RAM, multi_processor_count = CPU count, major/minor 0); `mem_get_info` → (available,
    total) RAM;
  * `Tensor.record_stream` (through the device mode, patch 3) → no-op.
  `empty_cache`, `memory_stats`, `memory_allocated`, `memory_reserved`, `max_memory_allocated`
  already return empty values on a CPU-only torch and are left alone.
Why: megatron-core calls these unconditionally (megatron-core 0.19.2):
  `synchronize` — pipeline_parallel/p2p_communication.py `_communicate` (every PP send/recv),
  dist_checkpointing/strategies/filesystem_async.py `preload_tensors` (every torch_dist save),
  fully_parallel.py, async_utils.py, tensor_aware_state_dict.py, timers.py, parallel_state.py,
  distributed/distributed_data_parallel.py `offload_grad_buffers` / `restore_grad_buffers`;
  `current_stream` / `stream` / `Stream.wait_stream` — distributed/param_and_grad_buffer.py
  `start_grad_sync` / `finish_grad_sync` (overlap_grad_reduce) and the stream users in
  pipeline_parallel/utils.py, fine_grained_activation_offload.py, combined_1f1b.py;
  `Event` — utils.py StragglerDetector, transformer/transformer_layer.py, offloading;
  `nvtx.range_push/pop` — utils.py `nvtx_range_push/pop` once `configure_nvtx_profiling(True)`;
  `get_device_properties` / `get_device_capability` — feature checks in GPU-only modules
  (batch-invariant kernels, fusions, TE extensions), answered "no GPU features".
  A CPU-only torch raises on most of them ("Torch not compiled with CUDA enabled").
Why the math is unchanged: on CPU every op runs synchronously on one stream, so there is nothing
  to order or wait for; NVTX and memory statistics are observability only. Device queries return
  "no GPU features" (capability 0.0), which disables GPU-only fast paths rather than changing math.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21.
Removable when: megatron-core guards these with `torch.cuda.is_available()` or uses the
  device-generic `torch.accelerator` / `torch.Stream` / `torch.Event` APIs.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch

from megatron_patches import device_mode
from megatron_patches._setattr import AttrPatcher

_patcher = AttrPatcher()


def _noop(name: str):
    """A fresh no-op per attribute: torch._dynamo keys rules by function object and rejects one
    object registered under several torch names."""

    def noop(*args, **kwargs) -> None:
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


class CpuEvent:
    """Stands in for torch.cuda.Event: records wall time, never waits."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self._time = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        return (end_event._time - self._time) * 1000.0


class CpuStream(torch.Stream):
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so ordering is a no-op.

    A `torch.Stream` (on "cpu") so that `tensor.record_stream(stream)` passes torch's argument
    parsing and reaches the device mode, which turns it into a no-op.
    """

    cuda_stream = 0

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls, device="cpu", priority=priority)

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_DEFAULT_STREAM = CpuStream()


def _current_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


def _default_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


def _stream_context(stream=None):
    return contextlib.nullcontext()


def _nvtx_range(msg=None, *args, **kwargs):
    return contextlib.nullcontext()


class _NullDevice(contextlib.nullcontext):
    """Stands in for torch.cuda.device(i): selecting a device is meaningless on CPU."""

    def __init__(self, device=None):
        super().__init__()
        self.idx = -1


def _ram() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def _device_properties(device=None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="cpu",
        type="cpu",
        total_memory=_ram()[1],
        multi_processor_count=os.cpu_count() or 1,
        major=0,
        minor=0,
        is_integrated=False,
        is_multi_gpu_board=False,
        L2_cache_size=0,
        warp_size=1,
        gcnArchName="",
        uuid="cpu",
    )


def _record_stream(func, args, kwargs) -> None:
    return None


_TORCH_CUDA_REPLACEMENTS = {
    "synchronize": _noop("synchronize"),
    "set_device": _noop("set_device"),
    "set_stream": _noop("set_stream"),
    "reset_peak_memory_stats": _noop("reset_peak_memory_stats"),
    "reset_max_memory_allocated": _noop("reset_max_memory_allocated"),
    "Stream": CpuStream,
    "current_stream": _current_stream,
    "default_stream": _default_stream,
    "stream": _stream_context,
    "device": _NullDevice,
    "Event": CpuEvent,
    "is_current_stream_capturing": lambda: False,
    "get_device_capability": lambda device=None: (0, 0),
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": _device_properties,
    "mem_get_info": lambda device=None: _ram(),
}
_NVTX_REPLACEMENTS = {
    "range_push": _noop("range_push"),
    "range_pop": _noop("range_pop"),
    "range_start": _noop("range_start"),
    "range_end": _noop("range_end"),
    "mark": _noop("mark"),
    "range": _nvtx_range,
}


def apply() -> None:
    if _patcher:
        return
    for name, value in _TORCH_CUDA_REPLACEMENTS.items():
        _patcher.set(torch.cuda, name, value)
    for name, value in _NVTX_REPLACEMENTS.items():
        _patcher.set(torch.cuda.nvtx, name, value)
    device_mode.HANDLERS[torch.Tensor.record_stream] = _record_stream


def remove() -> None:
    device_mode.HANDLERS.pop(torch.Tensor.record_stream, None)
    _patcher.restore()
