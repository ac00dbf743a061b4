"""Per-rank function of the measured-memory test (module level, so ranks can import it)."""

from __future__ import annotations


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measured_state_bytes(hf_path, layout) -> dict:
    """Build the actor engine at `layout` on this gloo world, run one update, and measure the bytes of
    the distinct storages of its parameters, main grads and optimizer state (fp32 main params + moments)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    import engine_cases as C

    from megarl.engine.config import OptimConfig
    from megarl.engine.offload import inner_optimizers
    from megarl.workers import Actor

    engine = C.build(hf_path, layout, first=True, optim=OptimConfig(lr=1e-6), micro_batch_tokens=1000)
    Actor(engine).update(C.local_rows(engine, C.padded_batch()))
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    optim = []
    for inner in inner_optimizers(engine.optimizer):
        optim += [
            p for g in inner.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in param_ptrs
        ]
        optim += [
            v for state in inner.state.values() for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0
        ]
    return {"weights": _storage_bytes(params), "grads": _storage_bytes(grads), "optimizer": _storage_bytes(optim)}
