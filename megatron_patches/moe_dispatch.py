"""Patch 6 — MoE all-to-all token dispatcher: split sizes reach `all_to_all_single` as host lists.

What: `token_dispatcher.maybe_move_tensor_to_cpu` (imported by name from `moe/moe_utils.py`) is
  replaced by a version that, for a tensor already on the CPU and `as_numpy=True`, returns its
  numpy array — what the original returns for a CUDA tensor after the device-to-host copy.
Why: `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` turns its per-rank split sizes
  (`input_splits`, `output_splits`, `output_splits_tp`) into host arrays with this helper, which
  converts only `tensor.is_cuda` tensors. On CPU the splits stay tensors, and
  `torch.distributed.all_to_all_single(output_split_sizes=<tensor>)` raises "incompatible function
  arguments". Without this patch only the allgather dispatcher runs on CPU, and megatron-core
  refuses that one with `variable_seq_lengths=True` (which the training engine uses).
Why the math is unchanged: the same integers, as the same kind of host array as on a GPU; the
  dispatcher sends the same tokens to the same experts (dropless routing). CUDA tensors and
  `as_numpy=False` calls go to the original function.
Checked against: megatron-core 0.19.2 (torch 2.13.0+cpu), 2026-11-21: EP2 and TP2×EP2 logits of
  Mixtral / Qwen-MoE equal transformers' (tests/models/test_moe.py).
Removable when: `maybe_move_tensor_to_cpu` converts host tensors too (or the dispatcher calls
  `.tolist()` on the splits).
"""

from __future__ import annotations

import torch

from megatron_patches._setattr import AttrPatcher

_patcher = AttrPatcher()


def _host_splits(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def apply() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    if not _patcher:
        _patcher.set(
            token_dispatcher, "maybe_move_tensor_to_cpu", _host_splits(token_dispatcher.maybe_move_tensor_to_cpu)
        )


def remove() -> None:
    _patcher.restore()
