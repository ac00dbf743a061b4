"""megatron-core and transformers' model configs imported without paying for torch's compiler up front.

megatron-core decorates its fused element-wise functions with `torch.compile` as it is imported
(`megatron.core.jit.jit_fuser`). The first `torch.compile(fn)` of a process imports torch's inductor
and export stacks: 2.1 of the 4.1–4.2 s `import megatron.core` took on this 2-core VM (2.0 s with
the compile deferred). Every process that imports megatron-core pays it: the rank server and so every
conversion, each Ray worker of a training run, vLLM-free test ranks.

`install()` (called by `import megarl`) puts a finder on `sys.meta_path` (`first_import.FirstImportHook`)
that, when `megatron.core` is first imported, runs its package import with `torch.compile` replaced by
`deferred_compile`: each function megatron decorates then gets a wrapper that calls `torch.compile(fn, ...)`
at its first call, and that compiled function from then on. torch.compile itself compiles only at the first call too, so
nothing compiles later than before; only the compiler's import moves to the first fused call (if
any: megarl's CPU runs make none). Modules (`torch.compile(module)`) and every call outside megatron's
import get the real torch.compile. A process that imported megatron.core before megarl keeps the
normal import.

transformers' model configuration modules (`configuration_llama` and the rest) import, through
`type_validators` → `activations` → `flash_attention`, its continuous-batching cache, which decorates a
method with `torch.compiler.disable` as its class is defined; that decorator imports torch._dynamo (and
inductor's config with it): 0.55 of the 0.85–1.0 s a first `AutoConfig.from_pretrained` took in a process
that had imported torch and megatron-core here. Every conversion (the command and its rank server), the
trainer's driver and each model worker load a config. `install()` also hooks that cache module's first
import: inside it `torch.compiler.disable(fn)` returns `deferred_disable`'s wrapper, which disables `fn`
(importing torch._dynamo) at its first call and calls the disabled function from then on. Where
torch._dynamo is already imported the real decorator runs at once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

from megarl.utils.first_import import FirstImportHook

TARGET = "megatron.core"


def _built_at_first_call(fn, build):
    """A wrapper of `fn` that calls `build()` at its first call (once, whatever the threads) and from then on
    the function `build()` returned."""
    built = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def first_call_builds(*args, **kwargs):
        if not built:
            with lock:
                if not built:
                    built.append(build())
        return built[0](*args, **kwargs)

    return first_call_builds


def deferred_compile(real_compile):
    """A stand-in for `torch.compile` that compiles a function at its first call (same arguments)."""

    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **options)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real_compile(model, **options)
        return _built_at_first_call(model, lambda: real_compile(model, **options))

    return compile_later


def deferred_disable(real_disable):
    """A stand-in for `torch.compiler.disable(fn=None, recursive=True, *, reason=None)` that disables `fn`
    at its first call."""

    def disable_later(fn=None, recursive=True, *, reason=None):
        if fn is None:  # used as @torch.compiler.disable(recursive=...)
            return lambda f: disable_later(f, recursive, reason=reason)
        if "torch._dynamo" in sys.modules:
            return real_disable(fn, recursive, reason=reason)
        return _built_at_first_call(fn, lambda: real_disable(fn, recursive, reason=reason))

    return disable_later


@contextlib.contextmanager
def _replaced(owner, name: str, stand_in):
    """Within: `owner.name` is `stand_in(the real one)`; restored after."""
    real = getattr(owner, name)
    setattr(owner, name, stand_in(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


def compile_deferred():
    """Within: `torch.compile` of a function defers the compile to the function's first call."""
    import torch

    return _replaced(torch, "compile", deferred_compile)


def disable_deferred():
    """Within: `torch.compiler.disable(fn)` defers the disabling (and torch._dynamo's import) to `fn`'s first call."""
    import torch.compiler

    return _replaced(torch.compiler, "disable", deferred_disable)


def _deferred_import(execute, module) -> None:
    with compile_deferred():
        execute(module)


def _disable_deferred_import(execute, module) -> None:
    with disable_deferred():
        execute(module)


TRANSFORMERS_TARGET = "transformers.generation.continuous_batching.cache"
_hook = FirstImportHook(TARGET, _deferred_import)
_transformers_hook = FirstImportHook(TRANSFORMERS_TARGET, _disable_deferred_import)


def install() -> None:
    """Defer torch.compile during this process's first import of megatron.core, and torch.compiler.disable
    during that of transformers' continuous-batching cache (idempotent; nothing for a module already
    imported)."""
    _hook.install()
    _transformers_hook.install()
