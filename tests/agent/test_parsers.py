"""Tool-call parsers: hermes, pythonic, mistral; bad calls become malformed ToolCalls, never exceptions."""

import pytest

from megarl.agent import AgentConfig, AgentContext
from megarl.agent.parsers import TOOL_PARSERS, get_parser


def test_hermes_reads_calls_and_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    )
    parsed = get_parser("hermes")(text)
    assert parsed.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("calculator", {"expression": "2+3"}, None),
        ("search", {"query": "x"}, None),
    ]
    assert get_parser("hermes")("no calls here").calls == []


@pytest.mark.parametrize(
    "body, reason",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
    ],
)
def test_hermes_malformed_calls_carry_the_reason(body, reason):
    parsed = get_parser("hermes")("text " + body)
    assert len(parsed.calls) == 1 and reason in parsed.calls[0].error


def test_pythonic_reads_a_list_of_calls():
    parsed = get_parser("pythonic")('Sure. [calculator(expression="2*4"), search(query="cats", top_k=2)]')
    assert parsed.content == "Sure."
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": "2*4"}),
        ("search", {"query": "cats", "top_k": 2}),
    ]
    assert get_parser("pythonic")("just [1, 2] text").calls == []
    bad = get_parser("pythonic")("[f(x=open('a'))]").calls[0]
    assert bad.name == "f" and "literals" in bad.error
    assert "keyword arguments" in get_parser("pythonic")("[f(1)]").calls[0].error
    assert "not a Python list" in get_parser("pythonic")("[f(a=1)").calls[0].error


def test_mistral_reads_tool_calls_json():
    parsed = get_parser("mistral")('ok[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1"}}]')
    assert parsed.content == "ok" and parsed.calls[0].arguments == {"expression": "1"}
    assert "not valid JSON" in get_parser("mistral")("[TOOL_CALLS][{").calls[0].error


def test_unknown_names_and_bad_limits_fail_when_the_context_is_built(tok):
    assert {"hermes", "pythonic", "mistral"} <= set(TOOL_PARSERS.names())
    with pytest.raises(ValueError, match="unknown tool parser 'qwen9'.*hermes"):
        AgentContext(tok, config=AgentConfig(tool_parser="qwen9"))
    with pytest.raises(ValueError, match="unknown agent loop 'react'.*single_turn"):
        AgentContext(tok, config=AgentConfig(default_agent="react"))
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        AgentContext(tok, config=AgentConfig(environment="chess"))
    with pytest.raises(ValueError, match="no_such_module"):
        AgentContext(tok, config=AgentConfig(openai_agent="no_such_module:solve"))
    with pytest.raises(ValueError, match="max_assistant_turns must be >= 1"):
        AgentConfig(max_assistant_turns=0)
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        AgentConfig(tool_response_truncate_side="top")
