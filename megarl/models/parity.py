"""Logit parity between a megatron-core model built by the bridge and `transformers`.

Owns: `megatron_logits` (a forward-only pass through megatron-core's pipeline schedule, TP shards
gathered, vocab padding dropped) and `check_parity` (HF weights → megatron at a layout, both
models on the same tokens, max |Δlogit|). Used by tools/check_parity.py and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.models.layout import ParallelLayout


@dataclass
class ParityResult:
    max_abs_diff: float
    atol: float
    layout: ParallelLayout
    shape: tuple

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return (
            f"{verdict}: max |Δlogit| = {self.max_abs_diff:.3e} (tolerance {self.atol:.0e}) at tp={self.layout.tp}"
            f" pp={self.layout.pp} vpp={self.layout.vpp} ep={self.layout.ep}, logits {list(self.shape)}"
        )


def megatron_logits(chunks, input_ids: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Full-vocabulary logits [b, s, vocab] on the last pipeline stage (None on other stages).

    Each row is one micro-batch, so interleaved (virtual) pipelines get the >= PP micro-batches they need.
    The tokens go to the model's device (a GPU model is built on the current CUDA device); the logits
    come back on the CPU.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = input_ids.shape
    device = next(chunks[0].parameters()).device
    position_ids = torch.arange(seq, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        return model(next(data_iterator).to(device), position_ids, None), None

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(input_ids.split(1)) for _ in chunks],
            model=chunks,
            num_microbatches=batch,
            seq_length=seq,
            micro_batch_size=1,
            forward_only=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    return torch.cat([gather_from_tensor_model_parallel_region(out) for out in outputs])[..., :vocab_size].cpu()


def hf_logits(hf_path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits


def parity_rank(hf_paths: list[str], layout: ParallelLayout, input_ids: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """Per-rank work: for each HF model, load it into megatron at `layout` and return last-stage logits."""
    from megarl.models.bridge import ModelBridge
    from megarl.models.runtime import expert_ranks, init_megatron, ranks

    init_megatron(layout)
    tp_rank, pp_rank, _ = ranks()
    ep_rank, _ = expert_ranks()
    results = []
    for hf_path in hf_paths:
        bridge = ModelBridge.from_hf_path(hf_path, layout)
        chunks = bridge.build(pp_rank)
        bridge.load_hf_weights(chunks, hf_path, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
        for chunk in chunks:
            chunk.eval()
        results.append(megatron_logits(chunks, input_ids, bridge.dims.vocab_size))
    return results


def check_parity_many(
    hf_paths,
    layout: ParallelLayout = ParallelLayout(),
    *,
    batch: int = 2,
    seq: int = 16,
    atol: float = 1e-4,
    seed: int = 0,
) -> list[ParityResult]:
    """Run megatron (one spawned world of tp*pp*ep ranks for all models) and transformers on the same tokens."""
    from megarl.models.hf_config import describe_hf_config, load_hf_config
    from megarl.utils.distributed import run_distributed

    _check_sizes(batch=batch, seq=seq, atol=atol)
    all_dims = [describe_hf_config(load_hf_config(p)) for p in hf_paths]
    for dims in all_dims:  # fail here, not in the spawned ranks
        layout.check_dims(dims)
    vocab = min(dims.vocab_size for dims in all_dims)
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    per_rank = run_distributed(parity_rank, layout.min_world_size, [str(p) for p in hf_paths], layout, tokens)
    results = []
    for i, hf_path in enumerate(hf_paths):
        ours = next(r[i] for r in per_rank if r[i] is not None)
        reference = hf_logits(hf_path, tokens)
        results.append(ParityResult((ours - reference).abs().max().item(), atol, layout, tuple(reference.shape)))
    return results


def _check_sizes(*, batch: int, seq: int, atol: float) -> None:
    for flag, value in (("--batch", batch), ("--seq-len", seq)):
        if value < 1:
            raise ValueError(
                f"{flag}={value}: the parity check needs at least one token per sequence and one"
                f" sequence; pass {flag} >= 1"
            )
    if not atol >= 0:
        raise ValueError(f"--atol={atol} must be >= 0")


def check_parity(hf_path, layout: ParallelLayout = ParallelLayout(), **kwargs) -> ParityResult:
    """`check_parity_many` for one model."""
    return check_parity_many([hf_path], layout, **kwargs)[0]
