"""`import megarl` defers vLLM's import of inductor's lowering to the lowering's first import (`lazy_lowering`)."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

CHECK = textwrap.dedent(
    """
    import sys
    {before}
    import vllm
    print("torch._inductor.lowering" in sys.modules)
    import torch._inductor.graph as graph  # imports the lowering, as inductor's first compile does
    from torch._inductor import lowering
    print(type(lowering.FALLBACK_ALLOW_LIST).__name__, graph.FALLBACK_ALLOW_LIST is lowering.FALLBACK_ALLOW_LIST)
    print("vllm::some_op" in lowering.FALLBACK_ALLOW_LIST, "aten::add" in lowering.FALLBACK_ALLOW_LIST)
    """
)


def _run(before: str) -> list[str]:
    code = CHECK.format(before=before)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().split("\n")[-3:]


def test_vllm_after_megarl_leaves_the_lowering_and_its_first_import_gets_vllms_patch():
    # vLLM alone: the lowering imported with vLLM, its list wrapped, graph's name bound to the wrapper.
    assert _run("") == ["True", "_VllmFallbackAllowList True", "True False"]
    # After megarl: not imported with vLLM; once imported, the same wrapper in both places.
    assert _run("import megarl") == ["False", "_VllmFallbackAllowList True", "True False"]


def test_an_unverified_vllm_version_or_the_opt_out_imports_as_vllm_wrote_it():
    before = "import megarl.utils.lazy_lowering as lazy; lazy.VERIFIED = ()"
    assert _run(before) == ["True", "_VllmFallbackAllowList True", "True False"]
    before = "import os; os.environ['MEGARL_LAZY_LOWERING'] = '0'; import megarl"
    assert _run(before) == ["True", "_VllmFallbackAllowList True", "True False"]
