"""Engine-contract checks shared by the embedded and vLLM engine tests (any `RolloutEngine`)."""
import asyncio

from megarl.rollout import SamplingParams


def check_sampling_contract(engine):
    """n samples, seeds, stop tokens, finish reasons, log-probs consistent with teacher forcing."""
    prompt = [1, 5, 9, 13]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    first = engine.generate_sync([prompt], sampled)[0]
    again = engine.generate_sync([prompt], sampled)[0]
    assert len(first) == 3 and [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1  # n samples are not copies of one
    for c in first:
        assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == 8
        scored = engine.score([prompt + c.token_ids])[0][len(prompt) - 1:]
        assert max(abs(a - b) for a, b in zip(scored, c.logprobs)) < 1e-3, (scored, c.logprobs)

    greedy = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8))[0][0]
    stop = greedy.token_ids[3]
    cut = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,)))[0][0]
    first_stop = greedy.token_ids.index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids == greedy.token_ids[:first_stop + 1]


def check_concurrent_requests(engine):
    """Concurrent per-request calls with different params each get their own answers."""
    async def run():
        return await asyncio.gather(
            engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)),
            engine.generate([1, 7, 7, 7, 9], SamplingParams(temperature=0, max_tokens=6, n=2)),
            engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)),
        )

    a, b, c = asyncio.run(run())
    assert len(a) == 1 and len(b) == 2 and [x.token_ids for x in a] == [x.token_ids for x in c]
    assert len(b[0].token_ids) == 6 and b[0].token_ids == b[1].token_ids  # greedy: both samples agree
    assert all(x.version == engine.version for x in a + b + c)


def check_temperature_contract(engine, model_path, temperature=0.7, atol=1e-4):
    """Log-probs at the sampling temperature: a sampled token's is log_softmax(logits / T) of
    `transformers`' teacher-forced logits (fp32), a greedy token's log_softmax(logits) (T = 1)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine.update_weights(sorted(load_file(str(model_path / "model.safetensors")).items()))  # a known model
    prompt = [1, 5, 9, 13]
    sampled = engine.generate_sync([prompt], SamplingParams(temperature=temperature, max_tokens=8, n=2, seed=3))[0]
    greedy = engine.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for completions, temp in ((sampled, temperature), (greedy, 1.0)):
        for c in completions:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            targets = ids[0, len(prompt):, None]
            expected = torch.log_softmax(logits / temp, -1).gather(-1, targets)[:, 0]
            got = torch.tensor(c.logprobs)
            assert (got - expected).abs().max() < atol, (temp, got, expected)
            if temp != 1.0:  # the check can fail: temperature-1 log-probs are far from these
                assert (got - torch.log_softmax(logits, -1).gather(-1, targets)[:, 0]).abs().max() > 1e-2
