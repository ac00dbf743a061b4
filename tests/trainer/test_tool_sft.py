"""Tool-call SFT demonstrations: the exact token layout of the tool_agent loop, calls vs guesses."""

import asyncio
import random

import pytest
from train_helpers import REPO

from megarl.agent import AgentConfig, AgentContext, AgentSample, ReplayLLM, run_agent
from megarl.agent.tools import ToolSet
from megarl.data.tasks import make_tool_arithmetic_dataset
from megarl.data.tokenizer import build_tiny_tokenizer
from megarl.rollout.base import SamplingParams
from megarl.trainer.tool_sft import call_text, guessed_answer, tool_call_examples

TOOLS = REPO / "configs" / "tools" / "calculator.yaml"


@pytest.mark.parametrize("arguments_first", [False, True])
def test_a_calling_demonstration_is_token_for_token_what_the_tool_agent_loop_builds(tmp_path, arguments_first):
    """Either key order of the call's JSON is parsed and run by the loop (the quickstart writes arguments first)."""
    from megarl.rollout import create_engine
    from megarl.testing.models import save_tiny_policy

    tok = build_tiny_tokenizer(chat_template="compact_tools")
    save_tiny_policy(tmp_path, tok)
    row = make_tool_arithmetic_dataset(1, seed=4)[0]
    (call, call_len), (answer, answer_len) = tool_call_examples(
        [row], tok, ToolSet.from_yaml(TOOLS).schemas(), call_share=1.0, arguments_first=arguments_first
    )
    eos = tok.eos_token_id
    turns = [
        tok.encode(
            call_text(row["extra_info"]["expression"], arguments_first=arguments_first), add_special_tokens=False
        )
        + [eos],
        tok.encode(row["ground_truth"], add_special_tokens=False) + [eos],
    ]
    ctx = AgentContext(
        tok, SamplingParams(max_tokens=128, logprobs=True, stop_token_ids=(eos,)), AgentConfig(tool_config=str(TOOLS))
    )
    sample = AgentSample.from_row({"raw_prompt": row["prompt"], "agent_name": "tool_agent"})
    engine = create_engine(str(tmp_path), backend="embedded")  # scores the replayed (teacher) turns
    try:
        traj = asyncio.run(run_agent(sample, ReplayLLM(engine, tok, turns), ctx))
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    assert traj.finish_reason == "stop" and traj.metrics["tool_success"] == 1.0
    assert traj.prompt_ids + traj.response_ids == answer and call == answer[: len(call)]
    assert call_len == len(traj.prompt_ids) and answer[answer_len:] == turns[1]
    assert traj.reward_extras["final_response"] == row["ground_truth"]


def test_guessing_demonstrations_answer_wrong_by_one_digit_in_the_share_asked():
    tok = build_tiny_tokenizer(chat_template="compact_tools")
    rows = make_tool_arithmetic_dataset(200, seed=1)
    examples = tool_call_examples(rows, tok, ToolSet.from_yaml(TOOLS).schemas(), call_share=0.25, seed=2)
    calls = sum(tok.decode(ids[n:]).startswith("<tool_call>") for ids, n in examples)
    assert len(examples) == len(rows) + calls and 30 <= calls <= 70
    rng = random.Random(0)
    for answer in ("56876", "7", "100"):
        guess = guessed_answer(answer, rng)
        assert guess != answer and len(guess) == len(answer) and not guess.startswith("0") or len(answer) == 1
        assert sum(a != b for a, b in zip(guess, answer)) == 1
    with pytest.raises(ValueError, match="call_share"):
        tool_call_examples(rows, tok, [], call_share=1.5)


def test_exact_share_is_teacher_forced_argmax_and_stops_a_warm_up_early(tmp_path):
    """Examples built from the model's own argmax next token count as exact, the same with that token
    changed do not (prompts of several lengths, so padding and label shift are exercised); a warm-up
    with `until` stops at the first check where the share is reached."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.testing.models import save_tiny_policy
    from megarl.trainer.sft import exact_share, sft_warmup

    tok = build_tiny_tokenizer()
    save_tiny_policy(tmp_path, tok)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    exact, wrong = [], []
    for prompt in ("1+2=", "12+3=", "9*9*9="):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            a = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            b = int(model(torch.tensor([ids + [a]])).logits[0, -1].argmax())
        exact.append((ids + [a, b], len(ids)))
        wrong.append((ids + [a, (b + 1) % len(tok)], len(ids)))
    assert exact_share(model, exact) == 1.0 and exact_share(model, wrong) == 0.0
    assert exact_share(model, exact + wrong, batch_size=4) == 0.5 and not model.training
    losses = sft_warmup(str(tmp_path), exact * 4, steps=100, batch_size=4, until=(exact, 0.0), check_every=3)
    assert len(losses) == 3
