"""`megarl.utils.lazy_compile`: megatron-core's import defers torch.compile of its fused functions to
their first call, transformers' config imports defer `torch.compiler.disable` (and torch._dynamo's import) to
the decorated method's first call, and both leave torch as it was."""

import json
import subprocess
import sys
import textwrap

import torch

from megarl.utils.lazy_compile import compile_deferred, deferred_compile, deferred_disable


def test_a_deferred_function_compiles_once_at_its_first_call_with_the_same_options():
    compiled = []

    def fake_compile(model, **options):
        compiled.append((getattr(model, "__name__", type(model).__name__), options))
        return ("compiled", model) if isinstance(model, torch.nn.Module) else lambda x: ("compiled", model(x))

    compile_later = deferred_compile(fake_compile)

    @compile_later(dynamic=False)
    def double(x):
        return 2 * x

    assert compiled == [] and double.__name__ == "double" and double.__wrapped__(3) == 6
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert compiled == [("double", {"dynamic": False})]
    module = torch.nn.Linear(2, 2)  # a module is compiled (wrapped) at once, as torch.compile does
    assert compile_later(module, mode="max-autotune") == ("compiled", module)
    assert compiled[-1] == ("Linear", {"mode": "max-autotune"})


def test_a_module_is_compiled_at_once_and_torch_compile_is_restored():
    real = torch.compile
    seen = []
    with compile_deferred():
        assert torch.compile is not real
        seen.append(type(torch.compile(torch.nn.Linear(2, 2))).__name__)
    assert torch.compile is real
    assert seen == ["OptimizedModule"]


def test_importing_megatron_core_after_megarl_imports_no_compiler_and_keeps_torch_compile():
    code = textwrap.dedent(
        """
        import sys, torch
        real = torch.compile
        import megarl
        import megatron.core
        from megatron.core.fusions import fused_bias_geglu
        print(torch.compile is real)
        print("torch._inductor.compile_fx" in sys.modules)
        print(hasattr(fused_bias_geglu.geglu, "__wrapped__"), fused_bias_geglu.geglu.__name__)
        print(any(type(f).__name__ == "_MegatronImportFinder" for f in sys.meta_path))
        """
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == ["True", "False", "True geglu", "False"]


def test_a_deferred_disable_disables_once_at_the_first_call_with_the_same_arguments():
    disabled = []

    def fake_disable(fn, recursive, *, reason=None):
        disabled.append((fn.__name__, recursive, reason))
        return lambda *args, **kwargs: ("disabled", fn(*args, **kwargs))

    disable_later = deferred_disable(fake_disable)

    @disable_later(recursive=False, reason="views")
    def add(x, y=1):
        return x + y

    class Cache:  # a method, as transformers decorates one
        @disable_later
        def grow(self, n):
            return n * 2

    if "torch._dynamo" in sys.modules:  # this test process imported torch's compiler already: decorated at once
        assert [name for name, *_ in disabled] == ["add", "grow"]
    else:
        assert disabled == [] and add.__name__ == "add" and add.__wrapped__(3) == 4
    assert add(3, y=2) == ("disabled", 5) and add(4) == ("disabled", 5)
    assert Cache().grow(4) == ("disabled", 8) and Cache().grow(5) == ("disabled", 10)
    assert disabled == [("add", False, "views"), ("grow", True, None)]


def test_a_config_loads_without_importing_torch_dynamo_and_torch_compiler_disable_is_restored(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 128}))
    code = textwrap.dedent(
        f"""
        import sys, torch
        real = torch.compiler.disable
        import megarl
        from megarl.models.hf_config import load_hf_config
        cfg = load_hf_config({str(tmp_path)!r})
        print(torch.compiler.disable is real, "torch._dynamo" in sys.modules, cfg.model_type)
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        update = PagedAttentionCache.update  # decorated with torch.compiler.disable: disabled at its first call
        print(hasattr(update, "__wrapped__"), "torch._dynamo" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["True False llama", "True False"]
