"""The OpenAI-compatible endpoint, driven by the real `openai` client on localhost, and the `openai` loop."""

import json
from pathlib import Path

import openai
import pytest
from agent_helpers import encode, run
from openai_agents import CALCULATOR

from megarl.agent import AgentConfig, AgentContext, AgentSample, EngineLLM, ReplayLLM, run_agent
from megarl.agent.openai_server import ChatServer
from megarl.rollout import SamplingParams

HERE = Path(__file__).resolve().parent
END = "<|im_end|>"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>' + END


@pytest.fixture(scope="module")
def server(tok, engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=(tok.eos_token_id,))
    with ChatServer(tok, engine=engine, params=params, config=AgentConfig(max_response_tokens=600)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_chat_turns_of_one_session_become_one_trajectory(tok, engine, server, client):
    messages = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model="megarl", messages=messages, user="s1", seed=7, max_tokens=10)
    reply = first.choices[0].message
    assert reply.role == "assistant" and first.choices[0].finish_reason in ("stop", "length")
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model="megarl", messages=messages, user="s1", seed=8, max_tokens=10)
    [traj] = server.close_session("s1")

    prompt = encode(tok, tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False))
    params = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=(tok.eos_token_id,), seed=7)
    direct = run(engine.generate(prompt, params))[0]  # the engine's own answer to the same request
    assert traj.prompt_ids == prompt and traj.turns[0].text == reply.content
    assert traj.response_ids[: len(direct.token_ids)] == direct.token_ids
    assert traj.response_logprobs[: len(direct.token_ids)] == direct.logprobs
    assert [t.role for t in traj.turns] == ["assistant", "user", "assistant"]
    user = traj.turns[1]
    glue = "" if direct.token_ids[-1] == tok.eos_token_id else END
    assert traj.response_ids[user.start : user.end] == encode(
        tok, glue + "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.response_mask == [1] * user.start + [0] * (user.end - user.start) + [1] * (
        len(traj.response_ids) - user.end
    )
    assert traj.turns[2].text == second.choices[0].message.content
    assert second.usage.prompt_tokens == user.end + len(prompt)


def test_tool_calls_round_trip_through_the_openai_client(tok, engine, server, client):
    server.open_session(ReplayLLM(engine, tok, [CALL, "It is 5." + END]), session_id="tools")
    headers = {"X-Session-Id": "tools"}
    messages = [{"role": "user", "content": "What is 2+3?"}]
    first = client.chat.completions.create(
        model="megarl", messages=messages, tools=[CALCULATOR], extra_headers=headers, max_tokens=200
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    final = client.chat.completions.create(
        model="megarl", messages=messages, tools=[CALCULATOR], extra_headers=headers, max_tokens=200
    )
    assert final.choices[0].message.content == "It is 5." and final.choices[0].finish_reason == "stop"
    [traj] = server.close_session("tools")
    observation = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ids1, obs, ids2 = encode(tok, CALL), encode(tok, observation), encode(tok, "It is 5." + END)
    assert traj.response_ids == ids1 + obs + ids2
    assert traj.response_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
    assert "<tools>" in tok.decode(traj.prompt_ids)


def test_an_edited_history_starts_a_new_chain(tok, server, client):
    ask = [{"role": "user", "content": "One."}]
    client.chat.completions.create(model="megarl", messages=ask, user="s2", max_tokens=4)
    edited = ask + [{"role": "assistant", "content": "not what the model said"}, {"role": "user", "content": "Two."}]
    client.chat.completions.create(model="megarl", messages=edited, user="s2", max_tokens=4)
    chains = server.close_session("s2")
    assert len(chains) == 2 and all(t.response_mask == [1] * len(t.response_ids) for t in chains)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n": 2}, "'n' must be 1"),
        ({"stop": ["x"]}, "'stop' strings"),
        ({"messages": []}, "non-empty list"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client, fields, message):
    body = {"model": "megarl", "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**body)


def test_models_route_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == ["megarl"]


@pytest.mark.parametrize("agent_fn", ["calculator_agent", "sync_agent"])
def test_openai_agent_code_becomes_a_trajectory(tok, engine, agent_fn):
    config = AgentConfig(openai_agent=f"{HERE / 'openai_agents.py'}:{agent_fn}", max_response_tokens=600)
    ctx = AgentContext(tok, SamplingParams(temperature=0.0, max_tokens=200, stop_token_ids=(tok.eos_token_id,)), config)
    sample = AgentSample(messages=[{"role": "user", "content": "What is 2+3?"}], agent_name="openai")
    try:
        traj = run(run_agent(sample, ReplayLLM(engine, tok, [CALL, "It is 5." + END]), ctx))
        if agent_fn == "sync_agent":
            assert traj.response_ids == encode(tok, CALL) and traj.reward_extras["agent_result"] == CALL[: -len(END)]
            return
        assert traj.reward_extras["agent_result"] == "It is 5." and traj.num_turns == 2
        assert [t.role for t in traj.turns] == ["assistant", "tool", "assistant"]
        assert traj.turns[1].text == "5" and traj.metrics["openai_chains"] == 1
        plain = run(
            run_agent(
                sample,
                EngineLLM(engine),
                AgentContext(tok, ctx.params, AgentConfig(openai_agent=f"{HERE / 'openai_agents.py'}:sync_agent")),
            )
        )
        assert plain.num_turns == 1 and plain.response_mask == [1] * len(plain.response_ids)
    finally:
        ctx.close()
