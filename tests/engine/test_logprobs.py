"""Vocab-parallel log-probs and entropy equal a plain log_softmax computation (values and grads)."""

import pytest
import torch

from megarl.engine.logprobs import vocab_parallel_logprobs
from megarl.testing.dist import run_distributed

VOCAB, PADDED = 96, 128


def _inputs(seed=0, shape=(3, 7)):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, PADDED, generator=gen, dtype=torch.float64) * 3
    logits[..., VOCAB:] = 100.0  # padding columns hold garbage; they must not count
    target = torch.randint(0, VOCAB, shape, generator=gen)
    weights = (
        torch.randn(*shape, generator=gen, dtype=torch.float64),
        torch.randn(*shape, generator=gen, dtype=torch.float64),
    )
    return logits, target, weights


def _reference(logits, target, weights, temperature=1.0):
    """log_softmax over the real vocabulary; loss = w1·logp + w2·H; returns values and d loss/d logits."""
    logits = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits[..., :VOCAB] / temperature, dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((weights[0] * logp).sum() + (weights[1] * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), logits.grad


def _ours(logits, target, weights, group=None, temperature=1.0, chunk_tokens=4):
    logits = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(
        logits, target, tp_group=group, vocab_size=VOCAB, temperature=temperature, chunk_tokens=chunk_tokens
    )
    ((weights[0] * logp).sum() + (weights[1] * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), logits.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_tp1_match_log_softmax_values_and_grads(temperature):
    logits, target, weights = _inputs()
    for ours, ref in zip(
        _ours(logits, target, weights, temperature=temperature), _reference(logits, target, weights, temperature)
    ):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def test_logprobs_entropy_only_backward():
    logits, target, _ = _inputs(seed=3)
    x = logits.float().requires_grad_(True)
    _, entropy = vocab_parallel_logprobs(x, target, vocab_size=VOCAB)
    entropy.sum().backward()
    y = logits.float().requires_grad_(True)
    logp_all = torch.log_softmax(y[..., :VOCAB], -1)
    (-(logp_all.exp() * logp_all).sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5)


def test_logprobs_bad_shapes_raise():
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long))


def _tp2_rank(temperature):
    import torch.distributed as dist

    logits, target, weights = _inputs(seed=1)
    rank = dist.get_rank()
    shard = logits[..., rank * PADDED // 2 : (rank + 1) * PADDED // 2]
    logp, entropy, grad = _ours(shard, target, weights, group=dist.group.WORLD, temperature=temperature)
    ref = _reference(logits, target, weights, temperature)
    return [(logp, ref[0]), (entropy, ref[1]), (grad, ref[2][..., rank * PADDED // 2 : (rank + 1) * PADDED // 2])]


def test_logprobs_tp2_match_log_softmax_values_and_grads():
    for rank_pairs in run_distributed(_tp2_rank, 2, 0.8):
        for ours, ref in rank_pairs:
            torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
