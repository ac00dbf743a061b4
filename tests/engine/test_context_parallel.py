"""Context parallelism on CPU: everything except the attention itself (which needs Transformer Engine).

* the load-balanced split equals megatron-core's own (`get_batch_on_this_cp_rank`) and the
  all-gather + un-permute gives back the exact rows, for ragged rows at cp = 2 and 4;
* one CP=2 update through the engine's pieces (split, head gather, `_micro_loss` scaling,
  megatron's loss scaling, megatron DDP over dp_cp) on a per-token stand-in model equals cp=1:
  loss, every gradient, the log-probs — also for a sequence-level loss (GSPO, seq-mean-token-mean);
(cp > 1 without TE failing early, naming layout.cp and the fix: test_engine_inputs.py.)
"""

import cp_cases
import engine_cases as C
import pytest
import torch

from megarl.testing.dist import run_distributed


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_matches_megatron_zigzag_and_unpermute_is_exact_for_ragged_rows(cp, monkeypatch):
    from megatron.core import utils as mcore_utils

    from megarl.engine.context import split_for_cp, unpermute_from_cp

    micro_batches = cp_cases.cp_micro_batches(cp_cases.ragged_batch(), cp, max_tokens=20)
    assert len(micro_batches) > 1 and len({mb.tokens.shape[1] for mb in micro_batches}) > 1  # ragged widths
    for mb in micro_batches:
        assert mb.tokens.shape[1] % (2 * cp) == 0
        parts = [split_for_cp(mb.tokens, cp, r) for r in range(cp)]
        assert torch.equal(unpermute_from_cp(parts), mb.tokens)
        for rank, part in enumerate(parts):
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
            theirs = mcore_utils._get_batch_on_this_cp_rank_per_sequence_balancing({"tokens": mb.tokens}, None)
            assert torch.equal(part, theirs["tokens"])


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_gather_over_gloo_ranks_returns_the_full_rows(cp):
    per_rank = run_distributed(cp_cases.gather_round_trip_rank, cp, cp, apply_patches=False)
    for results in per_rank:
        for tokens, gathered_tokens, gathered_positions, local_width in results:
            assert local_width * cp == tokens.shape[1]
            assert torch.equal(gathered_tokens.long(), tokens)
            assert torch.equal(gathered_positions.long(), torch.arange(tokens.shape[1]).expand_as(tokens))


def _assert_matches_cp1(result):
    (ref_loss, ref_grads, ref_logp), (loss, grads, logp), _ = result
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    assert max(g.abs().max() for g in ref_grads) > 1e-3  # a real gradient
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_simulated_cp2_update_loss_grads_and_logprobs_equal_cp1(policy_loss):
    from megarl.algorithms import PolicyLossConfig

    loss = C.full_actor_loss()  # seq-mean-token-mean: per-sequence counts span both CP ranks
    loss.policy_loss = PolicyLossConfig(name=policy_loss)
    per_rank = run_distributed(cp_cases.simulated_cp2_rank, 2, loss)
    assert sorted(r[2] for r in per_rank) == [0, 1]
    for result in per_rank:
        _assert_matches_cp1(result)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from megarl.testing.models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("cp_engine") / "llama"
    save_tiny_hf_model("llama", path, seed=0)
    return str(path)


def test_engine_cp2_with_a_cpu_attention_stand_in_equals_cp1_updates_logprobs_and_checkpoints(llama, tmp_path):
    """The real engine at CP=2 (GPTModel, RoPE slicing, schedules, DDP + distributed optimizer over dp_cp,
    dist checkpointing) with only TE's attention replaced by a pure-torch K/V all-gather
    (`cp_cases.GatherKVAttention`)."""
    from test_engine_layouts import _assert_same, _merge

    from megarl.models.layout import ParallelLayout as L

    full, critic = {"loss": C.full_actor_loss()}, {"critic": True}
    scenarios = [
        (llama, L(), 1000),
        (llama, L(cp=2), 1000),
        (llama, L(cp=2), 14),
        (llama, L(), 14, full),
        (llama, L(cp=2), 14, full),
        (llama, L(), 1000, critic),
        (llama, L(cp=2), 1000, critic),
    ]
    per_rank = run_distributed(cp_cases.cp_engine_rank, 2, scenarios, llama, str(tmp_path), timeout=300)
    updates = [r[0] for r in per_rank]
    assert _merge(updates, 2)[2] >= 3  # several micro-batches
    for cp2, cp1 in [(1, 0), (2, 0), (4, 3), (6, 5)]:  # cp=1 here is DP=2, equal to one process (test_engine_layouts)
        _assert_same(_merge(updates, cp2), _merge(updates, cp1))
    batch = C.padded_batch()
    mask, expected = batch["response_mask"].bool(), C.hf_log_probs(llama, batch)
    for _, log_probs, (loaded, losses, norms, diff) in per_rank:
        torch.testing.assert_close(log_probs[mask], expected[mask], rtol=0, atol=1e-5)
        assert loaded  # a CP=2 checkpoint loads at CP=1 (DP=2) ...
        assert losses[0] == pytest.approx(losses[1], rel=1e-5) and norms[0] == pytest.approx(norms[1], rel=1e-4)
        assert diff < 1e-6  # ... with its optimizer state: the next step moves both alike
