"""Helpers shared by the agent tests."""

import asyncio

import torch


def run(coro):
    return asyncio.run(coro)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def teacher_forced_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1.. by one transformers forward pass (no KV cache)."""
    with torch.no_grad():
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()
