"""`megarl.utils.lazy_compile`: megatron-core's import defers torch.compile of its fused functions to
their first call, and leaves torch.compile as it was."""

import subprocess
import sys
import textwrap

import torch

from megarl.utils.lazy_compile import compile_deferred, deferred_compile


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
