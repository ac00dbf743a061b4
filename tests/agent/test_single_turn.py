"""The agent-loop contract: samples from rows, the registry, trajectories, and `single_turn` = today's rollout."""

import json

import numpy as np
import pytest
from agent_helpers import encode, run

from megarl.agent import (
    AGENT_LOOPS,
    AgentConfig,
    AgentContext,
    AgentSample,
    EngineLLM,
    Trajectory,
    get_agent_loop,
    run_agent,
    summarize,
)
from megarl.data.datasets import collate_prompts
from megarl.rollout import SamplingParams
from megarl.trainer.batching import requests

PROMPTS = ["What is 2+3?", "Name a colour.", "Count to three:"]


def _items(tok):
    items = []
    for i, text in enumerate(PROMPTS):
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        items.append(
            {
                "input_ids": np.array(encode(tok, rendered)),
                "raw_prompt": text,
                "ground_truth": str(i),
                "data_source": "arithmetic",
                "dataset_index": i,
                "extra_info": {"k": i},
            }
        )
    return items


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_single_turn_reproduces_todays_rollout_tokens_and_logprobs(tok, engine, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=12, stop_token_ids=(tok.eos_token_id,))
    items = _items(tok)
    today = requests(collate_prompts(items, tok.pad_token_id), params, seed=100)
    ctx = AgentContext(tok, params, AgentConfig())
    for row, (ids, row_params) in enumerate(today):
        direct = run(engine.generate(ids, row_params))[0]
        sample = AgentSample.from_row(items[row], seed=100 + row)
        traj = run(run_agent(sample, EngineLLM(engine), ctx))
        assert traj.prompt_ids == ids
        assert traj.response_ids == direct.token_ids
        assert traj.response_logprobs == direct.logprobs
        assert traj.response_mask == [1] * len(direct.token_ids)
        assert traj.response_versions == [engine.version] * len(direct.token_ids)
        assert traj.finish_reason == direct.finish_reason and traj.num_turns == 1
        assert traj.metrics["masked_token_share"] == 0.0


def test_sample_from_row_reads_the_dataset_columns():
    row = {
        "input_ids": np.array([5, 6, 7]),
        "raw_prompt": "hi",
        "ground_truth": "4",
        "data_source": "gsm8k",
        "extra_info": {"a": 1},
        "agent_name": "tool_agent",
        "tools": "calculator, search",
        "dataset_index": 9,
        "my_column": "x",
    }
    sample = AgentSample.from_row(row, seed=3)
    assert sample.messages == [{"role": "user", "content": "hi"}]
    assert sample.prompt_ids == [5, 6, 7] and sample.seed == 3 and sample.index == 9
    assert sample.tools == ["calculator", "search"] and sample.agent_name == "tool_agent"
    assert sample.extra == {"my_column": "x"} and sample.extra_info == {"a": 1}
    chat = AgentSample.from_row({"raw_prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert [m["role"] for m in chat.messages] == ["system", "user"] and chat.agent_name is None
    with pytest.raises(ValueError, match="raw_prompt"):
        AgentSample.from_row({"input_ids": [1]})


def test_agent_name_picks_the_loop_and_unknown_names_list_the_valid_ones(tok, engine):
    calls = []

    @AGENT_LOOPS.register("test_echo_loop")
    async def echo(sample, llm, ctx):
        calls.append(sample.agent_name)
        return Trajectory([1, 2, 3]).finalize()

    sample = AgentSample(messages=[{"role": "user", "content": "x"}], prompt_ids=[1], agent_name="test_echo_loop")
    assert run(run_agent(sample, EngineLLM(engine), AgentContext(tok))).prompt_ids == [1, 2, 3]
    assert calls == ["test_echo_loop"]
    with pytest.raises(ValueError, match="single_turn.*tool_agent"):
        get_agent_loop("no_such_loop")
    with pytest.raises(TypeError, match=r"must accept \(sample, llm, ctx\)"):
        AGENT_LOOPS.register("bad_loop")(lambda sample: None)


def test_loop_returning_something_else_is_refused(tok, engine):
    @AGENT_LOOPS.register("test_bad_return")
    async def bad(sample, llm, ctx):
        return {"tokens": []}

    sample = AgentSample(messages=[], prompt_ids=[1], agent_name="test_bad_return")
    with pytest.raises(TypeError, match="not a Trajectory"):
        run(run_agent(sample, EngineLLM(engine), AgentContext(tok)))


def test_trajectory_checks_and_record(tok):
    traj = Trajectory([1, 2])
    traj.add_model_turn([3, 4], [-0.5, -0.25], version=7, text="ab")
    traj.add_observation("tool", [5, 6, 7], text="obs")
    traj.add_model_turn([8], [-1.0], version=8)
    traj.reward_turn(0.5)
    traj.reward_turn(1.0, traj.turns[0])
    traj.finalize(extra=2)
    assert traj.response_mask == [1, 1, 0, 0, 0, 1]
    assert traj.response_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert traj.response_versions == [7, 7, -1, -1, -1, 8]
    assert traj.turn_rewards() == [(1, 1.0), (5, 0.5)]
    assert traj.token_rewards() == [0, 1.0, 0, 0, 0, 0.5]
    assert traj.metrics["masked_token_share"] == 0.5 and traj.metrics["turns"] == 2 and traj.metrics["extra"] == 2
    record = json.loads(json.dumps(traj.to_record(tok)))
    assert record["num_turns"] == 2 and record["response_ids"] == [3, 4, 5, 6, 7, 8] and "response_text" in record
    with pytest.raises(ValueError, match="log-probs"):
        traj.add_model_turn([1, 2], [0.0], version=0)
    traj.finish_reason = "done"
    with pytest.raises(ValueError, match="finish_reason"):
        traj.check()
    with pytest.raises(ValueError, match="assistant turn"):
        Trajectory([1]).reward_turn(1.0)


def test_summarize_averages_metrics_and_counts_finish_reasons():
    a, b = Trajectory([1]), Trajectory([1])
    a.add_model_turn([2, 3], [0.0, 0.0], 0)
    a.reward_turn(1.0)
    a.finalize(tool_calls=2)
    b.add_model_turn([2], [0.0], 0)
    b.add_observation("user", [4, 5, 6])
    b.finish_reason = "max_turns"
    b.finalize()
    stats = summarize([a, b])
    assert stats["agent/tool_calls"] == 2.0 and stats["agent/response_tokens"] == 3.0
    assert stats["agent/masked_token_share"] == pytest.approx(0.375)
    assert stats["agent/finish/stop"] == 0.5 and stats["agent/finish/max_turns"] == 0.5
    assert stats["agent/rewarded_turns"] == 0.5 and summarize([]) == {}
