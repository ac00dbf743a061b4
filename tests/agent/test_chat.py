"""Chat-template rendering: the tiny template's tools section, observation deltas and end-of-turn glue."""

import pytest
from agent_helpers import encode

from megarl.agent.chat import ChatRenderer
from megarl.data.tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Add.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}


def test_tiny_template_without_tools_renders_plain_chatml(tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ]
    plain = build_tiny_tokenizer()
    plain.chat_template = CHATML_TEMPLATE
    for gen in (True, False):
        assert tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        ) == plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_tiny_template_renders_tools_calls_and_results_like_qwen(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": '{"x": "1+1"}'}}
            ],
        },
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "extra"},
    ]
    text = tok.apply_chat_template(messages, tools=[CALC], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert text.endswith(
        '<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "calculator",'
        ' "arguments": {"x": "1+1"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n2\n'
        "</tool_response>\n<tool_response>\nextra\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_observation_is_glue_plus_template_delta(tok):
    renderer = ChatRenderer(tok, [CALC])
    assert renderer.turn_end == "<|im_end|>\n"
    delta = "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    stopped = encode(tok, "2<|im_end|>")
    assert renderer.observation_ids(stopped, [{"role": "tool", "content": "2"}]) == encode(tok, delta)
    cut = encode(tok, "2+")  # a turn cut by length gets the whole end of turn
    assert renderer.observation_ids(cut, [{"role": "tool", "content": "2"}]) == encode(tok, "<|im_end|>" + delta)


def test_templates_that_cannot_give_deltas_fail_naming_the_problem():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has none"):
        ChatRenderer(tok)
    tok.chat_template = "{{ messages[-1]['content'] }}"  # renders only the last message: not prefix-stable
    with pytest.raises(ValueError, match="prefix-stable"):
        ChatRenderer(tok).delta_text([{"role": "user", "content": "x"}])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="drops assistant content"):
        ChatRenderer(tok)
