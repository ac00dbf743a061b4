"""Patch 2 — `torch.cuda.current_device()` → the CPU device.

What: while applied, `torch.cuda.current_device()` returns `torch.device("cpu")` instead of an
  int GPU index (a CPU-only torch raises "Torch not compiled with CUDA enabled").
Why: megatron-core passes `device=torch.cuda.current_device()` when it allocates parameters,
  gradient buffers and activations (megatron-core 0.19.2: tensor_parallel/layers.py weights and
  the all-gather buffers of linear_with_grad_accumulation, tensor_parallel/mappings.py and
  tensor_parallel/utils.py gather buffers, utils.py GlobalMemoryBuffer.get_tensor (attention
  workspace), distributed/param_and_grad_buffer.py (DDP param/grad buffers),
  pipeline_parallel/p2p_communication.py receive buffers,
  dist_checkpointing/strategies/state_dict_saver.py,
  models/common/embeddings/rotary_pos_embedding.py RoPE `inv_freq`,
  transformer/transformer_layer.py, optimizer/grad_scaler.py, optimizer/distrib_optimizer.py,
  rerun_state_machine.py (only for log messages)).
  Returning the CPU device makes these work even on a thread where the device mode (patch 3) is
  not active.
Why the math is unchanged: the value is used only as a placement; every tensor keeps its dtype,
  shape and values.
Not covered: sites that build `torch.device("cuda", torch.cuda.current_device())` or
  f"cuda:{...}" — nccl_allocator.py, fault_injector.py, distributed/fsdp/ (Megatron-FSDP) —
  are GPU-only features and stay unsupported on CPU.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21.
Removable when: megatron-core takes its device from `torch.accelerator.current_accelerator()`
  or from a config field instead of `torch.cuda.current_device()`.
"""

from __future__ import annotations

import torch

from megatron_patches._setattr import AttrPatcher

CPU = torch.device("cpu")
_patcher = AttrPatcher()


def _current_device() -> torch.device:
    return CPU


def apply() -> None:
    if not _patcher:
        _patcher.set(torch.cuda, "current_device", _current_device)


def remove() -> None:
    _patcher.restore()
