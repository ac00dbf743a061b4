"""Patch 1 — the model-parallel RNG tracker uses the CPU generator instead of the CUDA one.

What: while applied,
  * `megatron.core.tensor_parallel.random._get_cuda_rng_state` → `torch.get_rng_state()` and
    `_set_cuda_rng_state` → `torch.set_rng_state()` (used by `CudaRNGStatesTracker.fork`,
    `_get_all_rng_states` / `_set_all_rng_states` of activation checkpointing
    (`CheckpointFunction`, `_fork_rng`), `convert_cuda_rng_state`);
  * `torch.cuda.get_rng_state` / `set_rng_state` / `manual_seed` → the CPU
    generator's (used by `CudaRNGStatesTracker.add`, `model_parallel_cuda_manual_seed`,
    rerun_state_machine.py's state save/restore);
  * the tracker's "CPU RNG state changed within GPU RNG context" warning is filtered out: on CPU
    the tracked generator *is* the CPU generator, so that check fires on every forked dropout.
Why: a CPU-only torch has no CUDA generator ("Torch not compiled with CUDA enabled"), yet every
  TP layer, dropout and `model_parallel_cuda_manual_seed` go through the tracker.
Why the math is unchanged: on CPU all random ops (dropout, init on the device) draw from the CPU
  default generator, which is exactly the generator that plays the CUDA generator's role on a GPU.
  The tracker keeps its semantics: named states seeded as on GPU (data-parallel seed, seed + 2718 +
  tp_rank for the model-parallel state, ...), `fork()` switches to the named state and restores the
  outer one, activation recomputation replays the same state. Random streams differ from a GPU's
  (different generator algorithm), as they would between any two devices.
Not covered: CUDA-graph-safe RNG (`use_cudagraphable_rng=True`, TE's tracker) raises a clear
  error; it has no meaning without CUDA graphs.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21.
Removable when: megatron-core's tracker takes the generator of the active device (e.g. via
  `torch.accelerator` / `torch.get_device_module`) instead of hard-coding `torch.cuda`.
"""

from __future__ import annotations

import logging

import torch

from megatron_patches._setattr import AttrPatcher

_patcher = AttrPatcher()
_LOGGER_NAME = "megatron.core.tensor_parallel.random"
_CPU_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class _DropCpuRngChangedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _CPU_RNG_WARNING


_filter = _DropCpuRngChangedWarning()


def _get_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    if graph_safe:
        raise NotImplementedError(
            "CUDA-graph-safe RNG (use_cudagraphable_rng / TE RNG tracker) has no CPU equivalent; "
            "megatron_patches supports the default RNG tracker only."
        )
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False) -> None:
    if graph_safe:
        _get_rng_state(graph_safe=True)
    torch.set_rng_state(new_state)


def _manual_seed(seed) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all (left alone; a lazy no-op here).
    torch.default_generator.manual_seed(int(seed))


def _cuda_get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cuda_set_rng_state(new_state, device="cuda") -> None:
    torch.set_rng_state(new_state)


def apply() -> None:
    if _patcher:
        return
    from megatron.core.tensor_parallel import random as mcore_random

    _patcher.set(mcore_random, "_get_cuda_rng_state", _get_rng_state)
    _patcher.set(mcore_random, "_set_cuda_rng_state", _set_rng_state)
    _patcher.set(torch.cuda, "get_rng_state", _cuda_get_rng_state)
    _patcher.set(torch.cuda, "set_rng_state", _cuda_set_rng_state)
    _patcher.set(torch.cuda, "manual_seed", _manual_seed)
    logging.getLogger(_LOGGER_NAME).addFilter(_filter)


def remove() -> None:
    logging.getLogger(_LOGGER_NAME).removeFilter(_filter)
    _patcher.restore()
