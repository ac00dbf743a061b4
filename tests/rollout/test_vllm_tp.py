"""vLLM with rollout TP 2 (CPU build): both vLLM workers take every IPC bucket and load their slice.

Before the async engine, an IPC update reached only the worker on the host rank's address (the
others waited on addresses nobody served); now every worker connects to the engine's one listener
and takes each bucket (`sharding/ipc.py`). The engine starts from other weights; after an update
from the actor's checkpoint in small buckets its greedy output equals `transformers` on it.
"""

import pytest
from rollout_api_checks import checkpoint
from rollout_sync_checks import GREEDY, PROMPTS, hf_greedy, tokens

from megarl.rollout import SamplingParams, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


def test_vllm_tp2_engine_loads_ipc_updates_in_both_workers(rollout_models):
    from megarl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(rollout_models["qwen2_other"], tensor_parallel_size=2, update_bucket_bytes=40_000)
    try:
        assert engine.ipc_workers == 2
        before = tokens(engine.generate_sync(PROMPTS, SamplingParams(**GREEDY)))
        version = engine.update_weights(checkpoint(rollout_models["qwen2"]))
        after = engine.generate_sync(PROMPTS, SamplingParams(**GREEDY))
    finally:
        engine.shutdown()
    assert before == hf_greedy(rollout_models["qwen2_other"])
    assert tokens(after) == hf_greedy(rollout_models["qwen2"]) != before
    assert {v for cs in after for c in cs for v in c.versions} == {version}
