"""Batch: construction checks, row/column operations, mismatch messages, pickling."""

import pickle

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch


def make_batch(rows=4, offset=0):
    return Batch.from_dict(
        {
            "input_ids": torch.arange(rows * 3).reshape(rows, 3) + offset,
            "scores": torch.arange(rows, dtype=torch.float32) + offset,
        },
        {"uid": [f"p{i + offset}" for i in range(rows)]},
        meta={"step": 7},
    )


def assert_batches_equal(a: Batch, b: Batch):
    assert len(a) == len(b)
    assert a.keys() == b.keys()
    for key in a.tensors:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    for key in a.non_tensors:
        assert a[key].dtype == b[key].dtype, key
        assert list(a[key]) == list(b[key]), key
    assert a.meta == b.meta


def test_from_dict_rows_keys_contains_and_columns():
    batch = make_batch()
    assert len(batch) == 4
    assert batch.keys() == ["input_ids", "scores", "uid"]
    assert "uid" in batch and "scores" in batch and "nope" not in batch
    assert batch["uid"].dtype == object and list(batch["uid"]) == ["p0", "p1", "p2", "p3"]


def test_from_dict_row_mismatch_names_the_column():
    with pytest.raises(ValueError, match="'b' has 3 rows; the batch has 2"):
        Batch.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_from_dict_non_tensor_in_tensors_is_rejected():
    with pytest.raises(TypeError, match="'a'"):
        Batch.from_dict({"a": [1, 2]})


def test_nested_lists_become_one_object_per_row():
    batch = Batch.from_dict({"x": torch.zeros(2)}, {"msgs": [[1, 2], [3, 4]]})
    assert batch["msgs"].shape == (2,) and batch["msgs"][1] == [3, 4]


def test_missing_column_error_lists_columns():
    with pytest.raises(KeyError, match="input_ids, scores, uid"):
        make_batch()["missing"]


def test_select_shares_storage_and_copies_meta():
    batch = make_batch()
    sub = batch.select("scores", "uid")
    assert sub.keys() == ["scores", "uid"] and len(sub) == 4
    assert sub["scores"].data_ptr() == batch["scores"].data_ptr()
    sub.meta["step"] = 8
    assert batch.meta["step"] == 7


def test_pop_removes_from_source_and_returns_popped():
    batch = make_batch()
    popped = batch.pop("scores")
    assert popped.keys() == ["scores"] and batch.keys() == ["input_ids", "uid"]


def test_setitem_adds_column_and_checks_rows():
    batch = make_batch()
    batch["advantages"] = torch.ones(4, 3)
    assert "advantages" in batch.tensors
    with pytest.raises(ValueError, match="'bad' has 5 rows"):
        batch["bad"] = torch.ones(5)


def test_union_merges_columns_and_meta():
    batch = make_batch()
    other = Batch.from_dict({"values": torch.ones(4)}, meta={"lr": 0.1})
    merged = batch.union(other)
    assert merged.keys() == ["input_ids", "scores", "values", "uid"]
    assert merged.meta == {"step": 7, "lr": 0.1}
    assert "values" not in batch


def test_union_same_key_with_equal_data_is_allowed():
    batch = make_batch()
    merged = batch.union(batch.select("scores"))
    assert torch.equal(merged["scores"], batch["scores"])


def test_union_conflicting_key_names_the_key():
    other = Batch.from_dict({"scores": torch.zeros(4)})
    with pytest.raises(ValueError, match="'scores'"):
        make_batch().union(other)


def test_union_conflicting_meta_names_the_key():
    other = Batch.from_dict({"x": torch.zeros(4)}, meta={"step": 8})
    with pytest.raises(ValueError, match="meta 'step'"):
        make_batch().union(other)


def test_union_row_mismatch_says_both_counts():
    with pytest.raises(ValueError, match="4 and 2 rows"):
        make_batch().union(make_batch(rows=2))


def test_repeat_interleave_puts_copies_of_row_i_at_i_n_to_i_n_plus_n_minus_1():
    batch = make_batch(rows=3).repeat(2, interleave=True)
    assert batch["scores"].tolist() == [0, 0, 1, 1, 2, 2]
    assert list(batch["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert batch["input_ids"][3].tolist() == [3, 4, 5]


def test_repeat_without_interleave_tiles_the_batch():
    batch = make_batch(rows=3).repeat(2, interleave=False)
    assert batch["scores"].tolist() == [0, 1, 2, 0, 1, 2]
    assert list(batch["uid"]) == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert batch["input_ids"].shape == (6, 3)


def test_index_by_int_slice_index_tensor_and_bool_mask():
    batch = make_batch()
    assert batch[1]["scores"].tolist() == [1] and batch[-1]["scores"].tolist() == [3]
    assert batch[1:3]["scores"].tolist() == [1, 2]
    assert list(batch[torch.tensor([3, 0])]["uid"]) == ["p3", "p0"]
    assert batch[np.array([2])]["scores"].tolist() == [2]
    assert batch[[1, 1]]["scores"].tolist() == [1, 1]
    masked = batch[torch.tensor([True, False, True, False])]
    assert masked["scores"].tolist() == [0, 2] and list(masked["uid"]) == ["p0", "p2"]
    assert len(batch[[]]) == 0


def test_index_out_of_range_and_wrong_mask_length_raise():
    batch = make_batch()
    with pytest.raises(IndexError):
        batch[4]
    with pytest.raises(IndexError, match="4 rows"):
        batch[torch.tensor([True, False])]
    with pytest.raises(IndexError):
        batch[[0, 9]]


def test_split_concat_round_trip():
    batch = make_batch(rows=7)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert_batches_equal(Batch.concat(parts), batch)


def test_chunk_gives_exactly_k_parts_sizes_differ_by_at_most_one():
    batch = make_batch(rows=7)
    parts = batch.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert_batches_equal(Batch.concat(parts), batch)
    assert [len(p) for p in make_batch(rows=2).chunk(3)] == [1, 1, 0]


def test_concat_missing_key_names_the_key():
    with pytest.raises(ValueError, match="'scores' is only in batch 0"):
        Batch.concat([make_batch(), make_batch().select("input_ids", "uid")])


def test_concat_dtype_mismatch_names_the_key():
    other = make_batch()
    other["scores"] = other["scores"].double()
    with pytest.raises(ValueError, match="'scores' is torch.float32 in batch 0 but torch.float64 in batch 1"):
        Batch.concat([make_batch(), other])


def test_concat_trailing_shape_mismatch_names_the_key():
    other = make_batch()
    other["input_ids"] = torch.zeros(4, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="'input_ids' has trailing shape"):
        Batch.concat([make_batch(), other])


def test_to_device_moves_tensors_keeps_non_tensors():
    moved = make_batch().to("cpu")
    assert moved["scores"].device.type == "cpu" and list(moved["uid"])[0] == "p0"


def test_pickle_round_trip_keeps_dtypes_shapes_values():
    batch = make_batch()
    batch["bf16"] = torch.randn(4, 2).to(torch.bfloat16)
    batch["mask"] = torch.tensor([True, False, True, True])
    batch["grad"] = torch.ones(4, requires_grad=True) * 2
    batch["strided"] = torch.arange(8).reshape(4, 2)[:, 1]
    restored = pickle.loads(pickle.dumps(batch))
    batch["grad"] = batch["grad"].detach()
    assert_batches_equal(restored, batch)


def test_pickle_protocol5_ships_tensors_out_of_band_without_copies():
    batch = make_batch()
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(batch.tensors)
    assert len(data) < 1000  # no tensor bytes in-band
    restored = pickle.loads(data, buffers=buffers)
    assert restored["input_ids"].data_ptr() == batch["input_ids"].data_ptr()
    assert_batches_equal(restored, batch)


def test_pickle_of_read_only_buffers_gives_writable_tensors():
    batch = make_batch()
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    read_only = [memoryview(bytes(b.raw())) for b in buffers]
    restored = pickle.loads(data, buffers=read_only)
    restored["scores"].add_(1)  # must not touch read-only memory
    assert restored["scores"].tolist() == [1, 2, 3, 4]


# ---- the typed schema (megarl.data.schema) ------------------------------------------------------


def _rollout_batch():
    from megarl.data.schema import ROLLOUT

    return Batch.from_dict(
        {"input_ids": torch.ones(4, 6, dtype=torch.long), "response_mask": torch.ones(4, 3, dtype=torch.long)},
        {"uid": ["a", "a", "b", "b"]},
        schema=ROLLOUT,
    )


def test_a_rollout_batch_refuses_an_undeclared_column_naming_the_closest():
    batch = _rollout_batch()
    with pytest.raises(KeyError, match=r"no column 'old_logprobs'; did you mean 'old_log_probs'.*megarl.data.schema"):
        batch["old_logprobs"] = torch.zeros(4, 3)
    with pytest.raises(KeyError, match="no column 'my_column'; declared columns are listed"):
        batch.union(Batch.from_dict({"my_column": torch.zeros(4)}))  # worker results are checked on the way in
    assert "old_logprobs" not in batch


def test_a_rollout_batch_refuses_a_column_of_the_wrong_kind_or_rank():
    batch = _rollout_batch()
    with pytest.raises(TypeError, match=r"'advantages' must be float \[B,T\].*got int with shape \[4, 3\]"):
        batch["advantages"] = torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"'scores' must be float \[B\]"):
        batch["scores"] = torch.ones(4, 2)
    with pytest.raises(TypeError, match=r"'uid' must be object \[B\]"):
        batch["uid"] = torch.arange(4)


def test_rows_unions_concats_and_pickles_keep_the_schema():
    batch = _rollout_batch()
    derived = [
        batch[1:3],
        batch.select("uid"),
        batch.repeat(2),
        Batch.concat([batch, batch]),
        batch.union(Batch.from_dict({"old_log_probs": torch.zeros(4, 3)})),
        pickle.loads(pickle.dumps(batch)),
    ]
    for other in derived:
        assert other.schema is not None and other.schema.name == "rollout"
        with pytest.raises(KeyError):
            other["typo"] = np.zeros(len(other))
    extended = batch.schema.with_data_columns(["agent_name", "uid"])
    assert extended.columns["agent_name"].kind == "object" and extended.columns["uid"] is batch.schema.columns["uid"]
