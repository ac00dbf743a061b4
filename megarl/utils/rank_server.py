"""The server local ranks are forked from (multiprocessing's forkserver), started before the caller imports torch.

Owns: `PRELOAD`, what that server imports once so that each rank it forks starts without paying for it
(`megarl.utils.distributed.run_distributed`); `start_early()`, which starts it at once; and
`run_in_server(fn, *args)`, which runs a command's work in one child of it. `megarl convert` (but
`mcore-to-hf` at one rank, which forks none: `megarl.models.dcp_export`) and `megarl check-parity` call
`start_early` first thing, then hand their whole work (input checks, the ranks, the
report) to `run_in_server`: the command's own process imports no torch, megatron-core or transformers, and
the child, which has them all, checks the input in ~0.01 s and forks the ranks itself (`in_server_child`:
`run_distributed` then forks instead of asking a server). `megarl convert hf-to-mcore` of a 475 MiB model:
7.2–8.0 s with the server started by the first `run_distributed`, after the command's own imports and checks
(torch, transformers' config machinery: ~2.5 s of CPU) — 3.9 s of it from the launch of the ranks to their
end; 4.0–4.2 s with the server started first and both imports side by side on the two cores; 3.5–3.9 s with
the command's process idle (4 pairs against the form before, alternating).
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
    # what every model's configuration module imports (activations → flash_attention → generation; its
    # torch._dynamo import is deferred, megarl.utils.lazy_compile)
    "transformers.utils.type_validators",
]

_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA, AMD: ranks are spawned there, not forked


def gpu_machine() -> bool:
    """Whether this machine has GPUs, told by their driver's device files (no torch or CUDA import)."""
    return any(os.path.exists(path) for path in _GPU_DEVICE_FILES)


def start_early() -> bool:
    """Start the forkserver with `PRELOAD` now, without waiting for its imports; False where no rank will
    be forked from it: under torchrun (the ranks exist already) or on a machine with GPUs (ranks are spawned
    there, as `run_distributed` does where CUDA is available)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    if gpu_machine():
        return False
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return True


_in_server_child = False


def in_server_child() -> bool:
    """Whether this process runs `run_in_server`'s function. It starts with the server's imports and no thread, and
    `run_distributed` forks the ranks from it: a function that needs ranks starts them before any threaded torch
    work of its own (the conversion and parity commands check their input, then launch them)."""
    return _in_server_child


def run_in_server(fn, *args):
    """`fn(*args)` in one child of the server `start_early` started; returns what it returned (picklable).

    `fn` is found by name in the child (a module-level function). The child shares this process's stdout and
    stderr (the server's, inherited at `start_early`). An exception in `fn` is printed there by the child, and
    raised here as a RuntimeError naming its exit code; `megarl.cli` passes functions that return an exit code
    instead of raising."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_call, args=(fn, args, send), name="megarl-command", daemon=False)
    child.start()
    send.close()
    try:
        value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(
            f"the command's process (a child of the rank server) ended with exit code {child.exitcode}"
        ) from None
    finally:
        receive.close()
    child.join()
    return value


def _call(fn, args, send) -> None:
    global _in_server_child
    _in_server_child = True
    value = fn(*args)
    try:
        send.send(value)
    except BrokenPipeError:  # the command's process is gone (Ctrl-C reached both): nobody to tell
        pass
