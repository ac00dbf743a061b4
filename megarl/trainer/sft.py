"""A short supervised warm-up on reference answers, before RL (the quickstart uses it).

Owns: `sft_warmup(hf_path, rows, tokenizer, ...)`: next-token NLL on the response tokens
(prompt tokens masked out) of `prompt → answer + eos`, AdamW, single process on the HF model
(`transformers`), saved back in place with `save_pretrained`. For a tiny model on CPU this takes
seconds and teaches the answer format, so GRPO starts from a policy that sometimes answers right
instead of from random characters. Large models warm up with the Megatron engine under torchrun.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch


def sft_examples(rows: Sequence[dict], tokenizer, render=None) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + eos, prompt length) per row with `prompt` and `ground_truth`."""
    examples = []
    for row in rows:
        prompt = render(row["prompt"]) if render else row["prompt"]
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(str(row["ground_truth"]), add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return examples


def _batch(examples, pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, (seq, prompt_len) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, prompt_len:len(seq)] = torch.tensor(seq[prompt_len:])
    return ids, mask, labels


def sft_warmup(hf_path: str, examples: list[tuple[list[int], int]], *, steps: int = 100, batch_size: int = 32,
               lr: float = 3e-3, seed: int = 0, out_path: str | None = None) -> list[float]:
    """Train `steps` AdamW steps of answer-token NLL; save to `out_path` (default: in place). The losses."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad_id = model.config.pad_token_id or 0
    losses = []
    for _ in range(steps):
        ids, mask, labels = _batch(rng.sample(examples, min(batch_size, len(examples))), pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
    model.save_pretrained(out_path or hf_path)
    return losses


@torch.no_grad()
def greedy_accuracy(hf_path: str, examples: list[tuple[list[int], int]], max_new_tokens: int = 4) -> float:
    """Share of examples whose greedy continuation reproduces the answer (+ eos) exactly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    right = 0
    for seq, prompt_len in examples:
        out = model.generate(torch.tensor([seq[:prompt_len]]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
        answer = seq[prompt_len:]
        right += out[0, prompt_len:prompt_len + len(answer)].tolist() == answer
    return right / max(1, len(examples))
