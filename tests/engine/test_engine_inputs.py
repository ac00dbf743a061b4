"""Bad engine inputs fail before any process group, model or weight is built; micro-batch unpadding."""

import engine_cases as C
import numpy as np
import pytest
import torch

from megarl.engine.config import EngineConfig, OptimConfig
from megarl.engine.engine import validate_engine_config
from megarl.engine.micro import make_micro_batch, make_micro_batches, shard_for_dp
from megarl.engine.parallel import check_layout
from megarl.models.layout import LayoutError
from megarl.models.layout import ParallelLayout as L
from megarl.testing.models import save_tiny_hf_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_inputs") / "llama"
    save_tiny_hf_model("llama", path, seed=0)
    return path


@pytest.mark.parametrize(
    "layout, world, match",
    [
        (L(tp=3), 4, "not divisible by tp\\*pp\\*cp"),
        (L(tp=2, pp=2), 2, "world size 2 is not divisible"),
    ],
)
def test_layout_not_dividing_world_raises_before_building(llama, layout, world, match):
    with pytest.raises(LayoutError, match=match):
        validate_engine_config(llama, EngineConfig(layout=layout), world)


def test_layout_not_dividing_heads_or_layers_raises(llama):
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by tp=4"):
        validate_engine_config(llama, EngineConfig(layout=L(tp=4)), 4)
    with pytest.raises(LayoutError, match="num_hidden_layers=2 is not divisible by pp\\*vpp"):
        validate_engine_config(llama, EngineConfig(layout=L(pp=2, vpp=2)), 2)


def test_cp_and_ep_give_clear_errors(llama):
    from megarl.models.spec import te_available

    if not te_available():  # cp > 1 needs TE attention: refused here, naming the setting and the fix
        with pytest.raises(
            LayoutError, match=r"layout\.cp=2: context parallelism needs Transformer Engine.*layout\.cp=1"
        ):
            validate_engine_config(llama, EngineConfig(layout=L(cp=2)), 2)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        validate_engine_config(llama, EngineConfig(layout=L(ep=2)), 2)
    with pytest.raises(LayoutError, match="ep=4 must divide"):
        check_layout(L(ep=4), 2)


def test_bad_configs_name_the_fix():
    with pytest.raises(ValueError, match="decay_style"):
        OptimConfig(decay_style="exp")
    with pytest.raises(ValueError, match="min_lr"):
        OptimConfig(lr=1e-6, min_lr=1e-5)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")


def test_micro_batch_removes_left_padding_and_maps_back_to_response_columns():
    batch = C.padded_batch(rows=4, prompt=5, response=4)
    mb = make_micro_batch(batch, np.array([0, 2, 3]), width=0, num_rows=5)
    assert mb.tokens.shape[0] == 5 and mb.tokens[3:].eq(0).all()  # filler rows
    for i, row in enumerate([0, 2, 3]):
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        assert torch.equal(mb.tokens[i, : len(real)], real)
        assert torch.equal(mb.targets[i, : len(real) - 1], real[1:])
    # position p of the original row holds token p: mapping the shifted tokens back (shift 0) recovers them
    back = mb.to_response(mb.tokens, shift=0)
    mask = batch["response_mask"][[0, 2, 3]].bool()
    assert torch.equal(back[mask], batch["input_ids"][[0, 2, 3], -4:][mask])
    # shift 1: the position that predicts response token t has that token as its target
    assert torch.equal(mb.to_response(mb.targets)[mask], batch["input_ids"][[0, 2, 3], -4:][mask])


def test_micro_batches_respect_the_token_budget_and_dp_shards_cover_the_batch():
    batch = C.padded_batch(rows=8)
    mbs = make_micro_batches(batch, max_tokens=20)
    assert sorted(r for mb in mbs for r in mb.rows) == list(range(8))
    assert all(mb.num_tokens <= 20 or len(mb.rows) == 1 for mb in mbs)
    shards = [shard_for_dp(batch, 2, r) for r in range(2)]
    assert sum(len(s) for s in shards) == 8


def test_sequence_parallel_widths_are_multiples_of_tp():
    mbs = make_micro_batches(C.padded_batch(rows=8), max_tokens=20, width_multiple=4)
    assert all(mb.tokens.shape[1] % 4 == 0 for mb in mbs)
