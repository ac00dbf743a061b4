"""vLLM imported without importing torch inductor's lowering up front.

`import vllm` runs `vllm.env_override`, which (vLLM 0.32 on torch 2.13) imports `torch._inductor.lowering`
only to wrap its `FALLBACK_ALLOW_LIST` so that vLLM's custom ops fall back (`_patch_inductor_fallback_allow_list`):
1.0-1.3 s of CPU in every process that imports vLLM on this 2-core VM, the fork server's preload among them (on
the start-up's critical path), though a CPU run compiles nothing (`megarl.rollout.vllm_start.eager_on_cpu`).

`install()` (called by `import megarl`) puts a finder on `sys.meta_path` (`first_import.FirstImportHook`) that,
on the first import of `vllm.env_override`, runs that module with `torch._inductor.lowering` unimportable: vLLM's
patch then returns at its own `except ImportError`. A second hook applies the same function of vLLM's right after
`torch._inductor.lowering` is first imported (by the first compile, wherever it comes from): the list is wrapped
before any compile reads it, and `torch._inductor.graph`'s copy of the name is re-bound where graph imported it
first. Only for the vLLM versions in `VERIFIED` (another version imports as vLLM wrote it); a process that
imported vLLM or the lowering before megarl keeps the normal import. `MEGARL_LAZY_LOWERING=0` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys

from megarl.utils.first_import import FirstImportHook

TARGET = "vllm.env_override"
LOWERING = "torch._inductor.lowering"
PATCH = "_patch_inductor_fallback_allow_list"
VERIFIED = ("0.32.0",)  # env_override's only import of inductor at import time is PATCH's


class _Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == LOWERING:
            raise ImportError(f"{LOWERING} is imported at its first use (megarl.utils.lazy_lowering)")
        return None


@contextlib.contextmanager
def _without_lowering():
    blocker = _Unimportable()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


def _deferred_import(execute, module) -> None:
    version = getattr(sys.modules.get("vllm.version"), "__version__", None)
    if version not in VERIFIED or LOWERING in sys.modules or os.environ.get("MEGARL_LAZY_LOWERING") == "0":
        execute(module)
        return
    with _without_lowering():
        execute(module)
    patch = getattr(module, PATCH)
    FirstImportHook(LOWERING, lambda run, lowering: (run(lowering), patch())).install()


_hook = FirstImportHook(TARGET, _deferred_import)


def install() -> None:
    """Defer vLLM's import of inductor's lowering to the lowering's first import (idempotent; nothing if
    vLLM is already imported)."""
    _hook.install()
