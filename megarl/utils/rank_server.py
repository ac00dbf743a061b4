"""The server local ranks are forked from (multiprocessing's forkserver), started before the caller imports torch.

Owns: `PRELOAD`, what that server imports once so that each rank it forks starts without paying for it
(`megarl.utils.distributed.run_distributed`), and `start_early()`, which starts it at once. Imports no
torch: `megarl convert` and `megarl check-parity` call `start_early` first, so the server's imports
(torch, megatron-core, transformers' configs: ~3 s of CPU here) run while the command imports torch and
checks its input (another ~3 s) instead of after. Started late, by the first `run_distributed`, the two
came one after the other: `megarl convert hf-to-mcore` of a 475 MiB model, 7.2–8.0 s, of which 3.9 s from
the launch of the ranks to their end.
"""

from __future__ import annotations

import os

PRELOAD = [  # a module that is not installed (megatron.core on a machine without it) is skipped by the server
    "torch",
    "torch.distributed",
    "megarl",  # before megatron.core: its import then defers torch.compile (megarl.utils.lazy_compile)
    "megatron_patches",
    "megatron.core",
    "megatron.core.models.gpt",
    # every rank that builds a model reads its config.json with transformers' AutoConfig (1.4 s of imports
    # per rank otherwise)
    "transformers.models.auto.configuration_auto",
    # what every model's configuration module imports (activations → flash_attention → generation →
    # torch._dynamo): 0.5 s a rank otherwise, once megatron.core no longer imports torch's compiler
    "transformers.utils.type_validators",
]

_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA, AMD: ranks are spawned there, not forked


def start_early() -> bool:
    """Start the forkserver with `PRELOAD` now, without waiting for its imports; False where no rank will
    be forked from it: under torchrun (the ranks exist already) or on a machine with GPUs (ranks are spawned
    there, as `run_distributed` does where CUDA is available)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    if any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
        return False
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return True
