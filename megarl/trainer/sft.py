"""A short supervised warm-up on reference answers, before RL (the quickstart uses it).

Owns: `sft_warmup(hf_path, examples, ...)`: next-token NLL on the response tokens (prompt tokens
masked out) of `prompt → answer + eos`, AdamW (optionally decaying linearly to 0), single process
on the HF model (`transformers`), saved back in place with `save_pretrained`, optionally stopping
once `exact_share` (teacher-forced exact answers on held-out examples) reaches a target;
`sft_examples` (rows → token ids); `off_by_one_teacher` (the quickstart's sloppy demonstrations: a
share of numeric answers off by one); `greedy_answers` / `greedy_accuracy` (batched greedy decoding of held-out prompts).
For a tiny model on CPU a warm-up takes seconds to a minute and teaches the answer format and the
task, so RL starts from a policy that is often right instead of from random characters. Large models
warm up with the Megatron engine under torchrun. Imports torch and transformers only.
"""

from __future__ import annotations

import os
import random
from typing import Optional, Sequence

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


def off_by_one_teacher(rows: Sequence[dict], rate: float, seed: int = 0) -> list[dict]:
    """Copies of `rows` whose integer `ground_truth` is one too high in a `rate` share of them (drawn
    per row, deterministic in `seed`): demonstrations from a teacher with a systematic habit.

    A model imitating them learns the task and the habit together: it puts about `rate` of its
    probability on answer + 1, so with `rate` > 0.5 its greedy answer is mostly wrong although it
    knows the right one. A reward that checks the answer can then remove the habit.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1] (the share of answers off by one), got {rate}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = int(str(row["ground_truth"]).strip())
        out.append({**row, "ground_truth": str(answer + 1 if rng.random() < rate else answer)})
    return out


def _batch(examples, pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, (seq, prompt_len) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
    return ids, mask, labels


def warmup_threads() -> int:
    """torch threads for a quickstart's warm-up, which runs alone before training: two where this process may use
    two CPUs, else one. Fixed, not the machine's count, so that a seed warms up the same on any machine with two
    or more CPUs (threads change how a matmul's sums are split, so its rounding). On the 2-core VM (2026-11-28),
    against one thread: the GRPO quickstart's warm-up (128 rows of ~9 tokens) 300 steps in 16.8 and 15.3 against
    19.6 and 17.8 s, its model bit-identical; the tool quickstart's (32 rows of ~150 tokens) 188 against 265 s for
    seed 0, the same step counts and starting point."""
    return min(2, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else min(2, os.cpu_count() or 1)


def sft_warmup(
    hf_path: str,
    examples: list[tuple[list[int], int]],
    *,
    steps: int = 100,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    out_path: str | None = None,
    lr_decay: bool = False,
    until: Optional[tuple[list[tuple[list[int], int]], float]] = None,
    check_every: int = 50,
) -> list[float]:
    """Train up to `steps` AdamW steps of answer-token NLL (lr constant, or decaying linearly to 0 with
    `lr_decay`); save to `out_path` (default: in place). The losses. With `until=(held_out, share)`
    stop early, checked every `check_every` steps, once `exact_share(model, held_out)` reaches `share`
    (a skill that tiny models pick up after a plateau whose length varies by seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps if lr_decay else 1.0)
    pad_id = model.config.pad_token_id or 0
    losses = []
    for _ in range(steps):
        ids, mask, labels = _batch(rng.sample(examples, min(batch_size, len(examples))), pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if until and len(losses) % check_every == 0 and exact_share(model, until[0]) >= until[1]:
            break
    model.save_pretrained(out_path or hf_path)
    return losses


@torch.no_grad()
def exact_share(model, examples: Sequence[tuple[list[int], int]], batch_size: int = 64) -> float:
    """Share of examples whose every answer token is the model's argmax given the tokens before it
    (teacher forced: one forward per batch, no decoding). Leaves the model in the mode it was in."""
    was_training = model.training
    model.eval()
    pad_id = model.config.pad_token_id or 0
    exact = 0
    for start in range(0, len(examples), batch_size):
        ids, mask, labels = _batch(list(examples[start : start + batch_size]), pad_id)
        predicted = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
        wanted = labels[:, 1:]
        exact += int(((predicted == wanted) | (wanted == -100)).all(dim=1).sum())
    model.train(was_training)
    return exact / max(1, len(examples))


@torch.no_grad()
def greedy_answers(
    model, examples: list[tuple[list[int], int]], max_new_tokens: int = 4, batch_size: int = 256
) -> list[list[int]]:
    """The greedy continuation of each example's prompt (left-padded batches), up to and including eos.

    model: an HF checkpoint directory, or a loaded `transformers` causal LM (left in eval mode)."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    pad, eos = model.config.pad_token_id or 0, model.config.eos_token_id
    answers = []
    for start in range(0, len(examples), batch_size):
        prompts = [seq[:prompt_len] for seq, prompt_len in examples[start : start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        out = model.generate(
            ids,
            attention_mask=(ids != pad).long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        for row in out[:, width:].tolist():
            answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return answers


def greedy_accuracy(hf_path: str, examples: list[tuple[list[int], int]], max_new_tokens: int = 4) -> float:
    """Share of examples whose greedy continuation reproduces the answer (+ eos) exactly."""
    answers = greedy_answers(hf_path, examples, max_new_tokens)
    return sum(a == seq[prompt_len:] for a, (seq, prompt_len) in zip(answers, examples)) / max(1, len(examples))
