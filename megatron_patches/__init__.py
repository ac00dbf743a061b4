"""CPU/gloo backend for megatron-core: explicit, version-checked patches of its CUDA-only calls.

megatron-core assumes a GPU. On a machine without one (CI, laptops, the quickstart) six small
patches let it run on CPU with the gloo backend. Nothing happens at import time; call

    from megatron_patches import apply_cpu_patches, cpu_device_mode, patches_applied
    apply_cpu_patches()          # once per process (idempotent); pushes the device mode on this thread
    with cpu_device_mode():      # on any *other* thread that runs megatron code
        ...

`apply_cpu_patches()` never patches anything when `torch.cuda.is_available()`.

The patches (one module each; each module's docstring says what, why, why the math is unchanged,
the versions it was checked against and when it can go; README.md has the table):
  1. rng_tracker        model-parallel RNG tracker → CPU generator
  2. current_device     torch.cuda.current_device() → CPU device
  3. device_mode        device="cuda" / .cuda() / pin_memory=True → CPU (a TorchFunctionMode)
  4. cuda_runtime       streams, events, synchronize, memory stats, NVTX, device queries → no-ops
  5. tensor_type_names  tensor.type() reports "torch.cuda.FloatTensor" for CPU float tensors
  6. moe_dispatch       MoE all-to-all dispatcher: CPU split sizes → host arrays for all_to_all_single
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from megatron_patches.device_mode import (
    CpuDeviceMode,
    cpu_device_mode,
    device_mode_suspended,
    mode_active_on_this_thread,
)

__all__ = [
    "TESTED_MCORE_VERSIONS",
    "apply_cpu_patches",
    "check_mcore_version",
    "cpu_device_mode",
    "device_mode_suspended",
    "installed_mcore_version",
    "patches_applied",
    "remove_cpu_patches",
]

# megatron-core versions whose CUDA-only call sites these patches were checked against and tested with.
TESTED_MCORE_VERSIONS = ("0.19.2",)
ALLOW_UNTESTED_ENV = "MEGARL_ALLOW_UNTESTED_MCORE"

_lock = threading.Lock()
_applied = False
_pushed_modes = threading.local()


def installed_mcore_version() -> str:
    """The installed megatron-core version (from package metadata; no megatron import)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        from megatron.core import package_info

        return package_info.__version__


def check_mcore_version(version: str | None = None) -> None:
    """Raise (or warn, with MEGARL_ALLOW_UNTESTED_MCORE=1) if megatron-core's version is untested."""
    version = version or installed_mcore_version()
    if version in TESTED_MCORE_VERSIONS:
        return
    message = (
        f"megatron_patches: megatron-core {version} is installed, but the CPU patches were checked "
        f"only against {', '.join(TESTED_MCORE_VERSIONS)}. Install a tested version "
        f"(pip install --no-deps megatron-core=={TESTED_MCORE_VERSIONS[-1]}), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise RuntimeError(message)


def patches_applied() -> bool:
    """Whether apply_cpu_patches() has patched this process."""
    return _applied


def _push_device_mode() -> None:
    if mode_active_on_this_thread():
        return
    mode = CpuDeviceMode()
    mode.__enter__()
    _pushed_modes.mode = mode


def apply_cpu_patches() -> bool:
    """Apply the six CPU patches (once per process) and push the device mode on this thread.

    Returns False, doing nothing, when CUDA is available; True when the patches are in place.
    Raises RuntimeError naming the installed and the tested megatron-core versions if the
    installed one is untested (MEGARL_ALLOW_UNTESTED_MCORE=1 turns that into a warning).
    """
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if not _applied:
            check_mcore_version()
            for patch in _patch_modules():
                patch.apply()
            _applied = True
    _push_device_mode()
    return True


def _patch_modules() -> tuple:
    """The patch modules in the order they are applied (removed in reverse)."""
    from megatron_patches import cuda_runtime, current_device, moe_dispatch, rng_tracker, tensor_type_names

    return (rng_tracker, current_device, cuda_runtime, tensor_type_names, moe_dispatch)


def remove_cpu_patches() -> None:
    """Undo apply_cpu_patches() (for tests): restore every replaced attribute and pop this
    thread's device mode if apply_cpu_patches() pushed it and it is on top."""
    global _applied
    with _lock:
        if _applied:
            for patch in reversed(_patch_modules()):
                patch.remove()
            _applied = False
    mode = getattr(_pushed_modes, "mode", None)
    stack = torch.overrides._get_current_function_mode_stack()
    if mode is not None and stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
        _pushed_modes.mode = None
