"""Tool-agent GRPO end to end through Ray with vLLM CPU: rows whose `agent_name` is `tool_agent`, the
calculator tool from a tool YAML, a TP2 actor in two gloo worker processes, the engines' turns routed
by the driver's agent rollout.

A fresh tiny model never writes a tool call, so the fixture first teaches the call format with a short
SFT warm-up on demonstrations in the exact token layout of the loop (`megarl.trainer.tool_sft`). Then:
losses finite with a nonzero policy gradient, the dumped rollouts hold assistant turns with parsed calculator calls followed by tool
turns whose tokens the loss does not train on (the mask holes), and the agent metrics reach
metrics.jsonl.
"""

import json

import pytest
import torch
from train_helpers import HERE, REPO, overrides, run_train

from megarl.rollout import vllm_available
from megarl.trainer.metrics import read_metrics

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (CPU build) is not installed")


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory):
    """{"model", "train", "test"}: hidden 64 / 2 heads of 32, the compact tool template, warmed up to call."""
    from megarl.agent.tools import ToolSet
    from megarl.data.datasets import load_rows
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_policy
    from megarl.trainer.sft import sft_warmup
    from megarl.trainer.tool_sft import tool_call_examples

    root = tmp_path_factory.mktemp("tool_task")
    tok = build_tiny_tokenizer(chat_template="compact_tools")
    save_tiny_policy(root / "model", tok)
    paths = write_task_splits("tool_arithmetic", 120, str(root / "data"))
    schemas = ToolSet.from_yaml(REPO / "configs" / "tools" / "calculator.yaml").schemas()
    examples = tool_call_examples(load_rows(paths["train"])[0], tok, schemas, call_share=1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft_warmup(str(root / "model"), examples[::2], steps=120, batch_size=16, lr=5e-3, lr_decay=True)
    finally:
        torch.set_num_threads(threads)
    return {"model": str(root / "model"), **paths}


def test_tool_agent_grpo_with_vllm_trains_on_model_tokens_only(tool_task, tmp_path):
    run = tmp_path / "run"
    args = overrides(
        tool_task,
        run,
        "trainer.total_steps=2",
        "trainer.dump_rollouts_every_steps=1",
        "validation.every_steps=0",
        "trainer.export_hf_at_end=false",
        "data.apply_chat_template=true",
        "rollout.max_response_tokens=128",
        "rollout.agent.max_assistant_turns=2",
        "rollout.temperature=0.5",  # the short warm-up's calls are clean at 0.5 (at 1.0 often garbled)
        # rewards that vary within a group (the warmed-up model cannot multiply yet): nonzero
        # advantages, so the policy gradient really runs over the masks with holes
        f"reward.reward_fn={HERE / 'hash_reward.py'}:reward",
        f"rollout.agent.tool_config={REPO / 'configs' / 'tools' / 'calculator.yaml'}",
    )
    code, out, seconds = run_train("tool_agent_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    print(f"tool-agent GRPO run: {seconds:.0f} s")
    rows = [m for m in read_metrics(run / "metrics.jsonl") if "actor/loss" in m]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["actor/loss"])), r
        for key in (
            "agent/turns",
            "agent/tool_calls",
            "agent/tool_errors",
            "agent/masked_token_share",
            "perf/trajectories_per_s",
        ):
            assert key in r, (key, sorted(r))
    assert any(r["actor/grad_norm"] > 0 for r in rows), [r["actor/grad_norm"] for r in rows]
    assert max(r["agent/tool_calls"] for r in rows) > 0 and max(r["agent/masked_token_share"] for r in rows) > 0
    dump = [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dump) == 16
    called = [rec for rec in dump if rec.get("turns") and any(t["tool_calls"] for t in rec["turns"])]
    assert called, [rec["response"] for rec in dump]
    for rec in called:
        turns = rec["turns"]
        for before, after in zip(turns, turns[1:]):
            if before["role"] == "assistant" and before["tool_calls"] and after["role"] == "tool":
                assert before["tool_calls"][0]["name"] in ("calculator", "")
                assert len(after["tool_results"]) == len(before["tool_calls"])
                assert after["tokens"] > 0 and after["trained_tokens"] == 0  # tool result: a mask hole
        assert all(t["trained_tokens"] == t["tokens"] for t in turns if t["role"] == "assistant")
    assert any(t["role"] == "tool" for rec in called for t in rec["turns"])
