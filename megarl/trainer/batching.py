"""From prompts and completions to the training batch, and back to text for the reward.

Owns the driver-side glue between the rollout contract (token ids in; tokens, log-probs and a
finish reason out) and the engine's batch columns (`megarl.engine.micro`): a left-padded prompt
followed by a right-padded response.

    requests(prompts, params, seed)       one (prompt ids, SamplingParams) per prompt row, seeded
    rollout_batch(prompts, completions)   input_ids / attention_mask [B, P+T], response_mask and
                                          rollout_log_probs [B, T], uid (prompt group), finish_reason
    decode_responses(batch, tokenizer)    response texts for the reward functions
    outcome_rewards(scores, mask)         a score per row on its last response token [B, T]

Pure torch / numpy: no Ray, megatron or vLLM.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.rollout.base import SamplingParams

PROMPT_COLUMNS = ("input_ids", "attention_mask")


def requests(prompts: Batch, params: SamplingParams, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """One request per prompt row; sampled requests get seed + row (reproducible wherever they run)."""
    out = []
    for row in range(len(prompts)):
        ids = prompts["input_ids"][row][prompts["attention_mask"][row].bool()].tolist()
        out.append((ids, params if params.greedy else dataclasses.replace(params, seed=seed + row)))
    return out


def rollout_batch(prompts: Batch, completions: list, pad_token_id: int, group_prefix: str = "") -> Batch:
    """Prompt rows repeated once per completion (interleaved) with the responses appended."""
    n = len(completions[0])
    if any(len(c) != n for c in completions):
        raise ValueError("every prompt must have the same number of completions")
    flat = [c for per_prompt in completions for c in per_prompt]
    width = max(1, max(len(c.token_ids) for c in flat))
    response = torch.full((len(flat), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(flat), width, dtype=torch.long)
    rollout_log_probs = torch.zeros(len(flat), width)
    for i, c in enumerate(flat):
        length = len(c.token_ids)
        response[i, :length] = torch.tensor(c.token_ids, dtype=torch.long)
        response_mask[i, :length] = 1
        if c.logprobs is not None:
            rollout_log_probs[i, :length] = torch.tensor(c.logprobs)
    rows = prompts.select(*[k for k in prompts.keys() if k != "position_ids"]).repeat(n)
    rows["input_ids"] = torch.cat([rows["input_ids"], response], dim=1)
    rows["attention_mask"] = torch.cat([rows["attention_mask"], response_mask], dim=1)
    rows["response_mask"] = response_mask
    rows["rollout_log_probs"] = rollout_log_probs
    rows["uid"] = np.array([f"{group_prefix}{i // n}" for i in range(len(flat))], dtype=object)
    rows["finish_reason"] = np.array([c.finish_reason for c in flat], dtype=object)
    rows["policy_version"] = torch.tensor([c.version for c in flat], dtype=torch.long)
    return rows


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    """The response text of every row (special tokens such as the stop token dropped)."""
    width = batch["response_mask"].shape[1]
    responses = batch["input_ids"][:, -width:]
    mask = batch["response_mask"].bool()
    return [tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(len(batch))]


def outcome_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores → [B, T] token rewards with the score on each row's last model-generated token
    (the last 1 of the mask: right for masks with holes, where tool tokens sit between turns)."""
    mask = response_mask.bool()
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(mask.any(-1)).squeeze(-1)
    last = (mask.long() * torch.arange(1, mask.shape[1] + 1)).argmax(-1)
    out[rows, last[rows]] = scores[rows].float()
    return out


def minibatches(batch: Batch, rows_per_update: int, epochs: int) -> list[Batch]:
    """Consecutive slices of whole prompt groups (rows are grouped by prompt), `epochs` times."""
    return [part for _ in range(epochs) for part in batch.split(rows_per_update)]
