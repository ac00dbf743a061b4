"""The tool agent loop, token by token: scripted model turns (ReplayLLM: real engine log-probs), real tools."""

import json
from pathlib import Path

import pytest
from agent_helpers import encode, run, teacher_forced_logprobs

from megarl.agent import AgentConfig, AgentContext, AgentSample, EngineLLM, ReplayLLM, run_agent
from megarl.agent.tools.runner import TRUNCATION_MARK
from megarl.rollout import SamplingParams

HERE = Path(__file__).resolve().parent
END = "<|im_end|>"
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def call_text(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tool_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    custom = "".join(f"  - type: {HERE / 'agent_tools.py'}:{cls}\n" for cls in ("Raiser", "Hanger", "Flood", "Counter"))
    path.write_text("tools:\n  - type: calculator\n" + custom)
    return str(path)


def context(tok, tool_yaml, max_tokens=200, **config):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=(tok.eos_token_id,))
    return AgentContext(tok, params, AgentConfig(tool_config=tool_yaml, **{"max_response_tokens": 2000, **config}))


def replay(engine, tok, ctx, turns, tools=("calculator",), messages=QUESTION):
    sample = AgentSample(messages=messages, agent_name="tool_agent", tools=list(tools), index=0)
    return run(run_agent(sample, ReplayLLM(engine, tok, turns), ctx))


def test_two_turn_trajectory_tokens_mask_and_logprobs_by_hand(tok, engine, hf_model, tool_yaml):
    ctx = context(tok, tool_yaml)
    turn1, turn2 = call_text("calculator", expression="2+3") + END, "The answer is 5." + END
    traj = replay(engine, tok, ctx, [turn1, turn2])

    prompt = tok.decode(traj.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in prompt
    assert '"name": "explode"' not in prompt  # only the row's tools are rendered
    assert prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    observation = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ids1, obs, ids2 = encode(tok, turn1), encode(tok, observation), encode(tok, turn2)
    assert traj.response_ids == ids1 + obs + ids2
    assert traj.response_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
    assert traj.response_versions == [engine.version] * len(ids1) + [-1] * len(obs) + [engine.version] * len(ids2)

    forced = teacher_forced_logprobs(hf_model, traj.prompt_ids + traj.response_ids)[len(traj.prompt_ids) - 1 :]
    for i, (mask, logprob) in enumerate(zip(traj.response_mask, traj.response_logprobs)):
        assert logprob == pytest.approx(forced[i], abs=1e-4) if mask else logprob == 0.0

    assert [t.role for t in traj.turns] == ["assistant", "tool", "assistant"]
    assert traj.turns[0].tool_calls == [
        {"name": "calculator", "arguments": {"expression": "2+3"}, "id": "call_0_0", "error": None}
    ]
    assert traj.turns[1].tool_results[0]["text"] == "5" and (traj.turns[1].start, traj.turns[1].end) == (
        len(ids1),
        len(ids1) + len(obs),
    )
    assert traj.finish_reason == "stop" and traj.num_turns == 2
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["tool_errors"] == 0
    assert traj.metrics["masked_token_share"] == pytest.approx(len(obs) / len(traj.response_ids))


def test_bad_tool_calls_are_observations_the_model_sees_and_counted(tok, engine, tool_yaml):
    ctx = context(
        tok, tool_yaml, max_tokens=600, tool_timeout_s=0.3, max_parallel_calls=8, max_tool_response_tokens=100
    )
    turn1 = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"\n</tool_call>'
        + call_text("web_search", query="x")
        + call_text("calculator", expr="2")
        + call_text("explode")
        + call_text("hang")
        + call_text("flood")
        + END
    )
    tools = ["calculator", "explode", "hang", "flood"]
    traj = replay(engine, tok, ctx, [turn1, "I see." + END], tools=tools)
    assert traj.finish_reason == "stop" and traj.num_turns == 2
    errors = {k.split("/")[1]: v for k, v in traj.metrics.items() if k.startswith("tool_errors/")}
    assert errors == {
        "malformed": 1,
        "unknown": 1,
        "bad_args": 1,
        "raised": 1,
        "timeout": 1,
        "too_long": 1,
        "over_limit": 0,
    }
    obs = traj.turns[1]
    seen = tok.decode(traj.response_ids[obs.start : obs.end])
    blocks = seen.split("<tool_response>\n")[1:]
    assert len(blocks) == 6
    for block, expected in zip(
        blocks,
        [
            "malformed tool call: not valid JSON",
            "unknown tool 'web_search'",
            "'expression' is a required property",
            "explode raised RuntimeError: boom",
            "hang timed out after 0.3 s",
            TRUNCATION_MARK,
        ],
    ):
        assert expected in block
    assert traj.response_mask[obs.start : obs.end] == [0] * (obs.end - obs.start)


def test_pythonic_parser_drives_the_same_loop(tok, engine, tool_yaml):
    ctx = context(tok, tool_yaml, tool_parser="pythonic")
    traj = replay(engine, tok, ctx, ['[calculator(expression="6*7")]' + END, "42" + END])
    assert traj.turns[1].tool_results[0]["text"] == "42" and traj.finish_reason == "stop"


@pytest.mark.parametrize(
    "config, max_tokens, reason, tool_calls",
    [
        ({"max_assistant_turns": 1}, 200, "max_turns", 0),
        ({"max_tool_calls": 0}, 200, "tool_budget", 0),
        ({"max_response_tokens": 90}, 200, "length", 1),  # the tool ran, but its turn would not fit the budget
        ({}, 20, "length", 0),  # the turn itself was cut by max_tokens
        ({"max_assistant_turns": 2}, 200, "max_turns", 1),
    ],
)
def test_limits_end_the_loop_with_their_finish_reason(tok, engine, tool_yaml, config, max_tokens, reason, tool_calls):
    ctx = context(tok, tool_yaml, max_tokens=max_tokens, **config)
    turn = call_text("calculator", expression="1+1") + END
    traj = replay(engine, tok, ctx, [turn, turn, turn])
    assert traj.finish_reason == reason and traj.metrics["tool_calls"] == tool_calls
    assert traj.response_mask[-1] == 1  # a trajectory never ends on tokens the model did not generate
    assert len(traj.response_ids) <= ctx.config.max_response_tokens


def test_tool_step_and_trajectory_rewards(tok, engine, tool_yaml):
    ctx = context(tok, tool_yaml)
    turn = call_text("count") + call_text("count") + END
    traj = replay(engine, tok, ctx, [turn, "done" + END], tools=["count"])
    first = traj.turns[0]
    assert traj.turn_rewards() == [(first.end - 1, 0.5)]  # two calls of 0.25 on the calling turn's last token
    assert traj.reward_extras["tool_rewards"] == {"count": 2.0}


def test_tool_agent_needs_tools_and_known_tool_names(tok, engine, tool_yaml):
    sample = AgentSample(messages=QUESTION, agent_name="tool_agent")
    with pytest.raises(ValueError, match="tool_config"):
        run(run_agent(sample, EngineLLM(engine), AgentContext(tok)))
    sample.tools = ["calculator", "web"]
    with pytest.raises(ValueError, match=r"tools \['web'\]"):
        run(run_agent(sample, EngineLLM(engine), context(tok, tool_yaml)))


def test_tool_agent_on_the_engine_keeps_engine_tokens(tok, engine, hf_model, tool_yaml):
    """A real sampled run (the random model calls no tool): the response is the engine's, seed for seed."""
    params = SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=(tok.eos_token_id,))
    ctx = AgentContext(tok, params, AgentConfig(tool_config=tool_yaml))
    sample = AgentSample(messages=QUESTION, agent_name="tool_agent", tools=["calculator"], seed=11)
    traj = run(run_agent(sample, EngineLLM(engine), ctx))
    direct = run(engine.generate(traj.prompt_ids, SamplingParams(**{**params.__dict__, "seed": 11})))[0]
    assert traj.response_ids == direct.token_ids and traj.response_logprobs == direct.logprobs
    assert traj.finish_reason == direct.finish_reason
