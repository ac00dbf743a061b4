import importlib.util
import json
import logging
import os

import numpy as np
import pytest
import torch

from megarl.data.datasets import DataConfig, PromptDataset, PromptLoader, collate_prompts, save_rows, truncate
from megarl.data.tokenizer import build_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _rows(n=10, prefix="q"):
    return [
        {
            "prompt": [{"role": "user", "content": f"{prefix}{i}"}],
            "ground_truth": str(i),
            "data_source": "arithmetic",
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def _write(tmp_path, rows, name="data.parquet"):
    path = str(tmp_path / name)
    save_rows(rows, path)
    return path


def _dataset(tmp_path, tokenizer, rows=None, **kwargs):
    return PromptDataset(DataConfig(files=[_write(tmp_path, rows or _rows())], **kwargs), tokenizer)


# ---------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_is_char_level_with_chatml_and_small_vocab(tokenizer):
    assert len(tokenizer) < 128
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer("12+3= ab", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tokenizer.decode(ids) == "12+3= ab"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_tokenizer_saved_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tiny_tokenizer(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token_id == loaded.convert_tokens_to_ids("<|im_end|>")
    assert loaded.decode(loaded("7*8=56\n")["input_ids"]) == "7*8=56\n"
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).startswith("<|im_start|>user")


def test_tiny_tokenizer_beside_a_qwen2_model_keeps_spaces_and_newlines(tmp_path):
    """load_tokenizer (what the trainer uses): AutoTokenizer alone would pick Qwen2Tokenizer from config.json
    and rebuild a byte-level pre-tokenizer that drops whitespace."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.testing.models import save_tiny_hf_model

    tok = build_tiny_tokenizer(chat_template="compact_tools")
    save_tiny_hf_model(
        "qwen2", tmp_path, vocab_size=len(tok), hidden_size=64, num_heads=2, num_kv_heads=2, tokenizer=tok
    )
    loaded = load_tokenizer(str(tmp_path))
    text = '<tool_call>\n{"name": "calculator"}\n</tool_call>'
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.chat_template == tok.chat_template


def test_compact_tools_template_lists_tool_names_and_renders_calls_and_results():
    tok = build_tiny_tokenizer(chat_template="compact_tools")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "12*34="},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
            ],
        },
        {"role": "tool", "content": "408"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\n12*34=<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}'
        "\n</tool_call><|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="chat_template must be one of"):
        build_tiny_tokenizer(chat_template="nope")


# ---------------------------------------------------------------- reading and validation


def test_chat_template_applied_decoded_prompt_starts_with_im_start_user(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer)
    text = tokenizer.decode(ds[3]["input_ids"])
    assert text.startswith("<|im_start|>user\nq3<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert ds[3]["raw_prompt"] == [{"role": "user", "content": "q3"}]
    assert ds[3]["ground_truth"] == "3" and ds[3]["data_source"] == "arithmetic"
    assert ds[3]["extra_info"] == {"index": 3}


def test_raw_string_prompts_without_chat_template_tokenised_as_is(tmp_path, tokenizer):
    rows = [{"prompt": "1+2=", "ground_truth": 3}]
    ds = _dataset(tmp_path, tokenizer, rows, apply_chat_template=False)
    assert tokenizer.decode(ds[0]["input_ids"]) == "1+2="
    assert ds[0]["ground_truth"] == "3"  # non-string ground truths become strings
    assert ds[0]["data_source"] == "unknown"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "json", "hf_dir"])
def test_reads_every_file_format_alike(tmp_path, tokenizer, fmt):
    rows = _rows(4)
    if fmt == "hf_dir":
        import datasets

        path = str(tmp_path / "hf")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(path)
    elif fmt == "json":
        path = str(tmp_path / "d.json")
        with open(path, "w") as f:
            json.dump(rows, f)
    else:
        path = _write(tmp_path, rows, f"d.{fmt}")
    ds = PromptDataset(DataConfig(files=[path]), tokenizer)
    assert [ds[i]["ground_truth"] for i in range(4)] == ["0", "1", "2", "3"]
    assert ds[2]["raw_prompt"] == [{"role": "user", "content": "q2"}]


def test_hf_dir_with_missing_split_names_the_splits(tmp_path, tokenizer):
    import datasets

    path = str(tmp_path / "hf")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows(2))}).save_to_disk(path)
    with pytest.raises(ValueError, match=r"no split 'train'.*\['test'\]"):
        PromptDataset(DataConfig(files=[path]), tokenizer)


def test_several_files_are_concatenated(tmp_path, tokenizer):
    a, b = _write(tmp_path, _rows(3, "a"), "a.parquet"), _write(tmp_path, _rows(2, "b"), "b.jsonl")
    ds = PromptDataset(DataConfig(files=[a, b]), tokenizer)
    assert len(ds) == 5 and ds[4]["raw_prompt"][0]["content"] == "b1"
    assert [ds[i]["dataset_index"] for i in range(5)] == list(range(5))


def test_dotted_ground_truth_key_reads_nested_column(tmp_path, tokenizer):
    rows = [{"prompt": "x", "reward_model": {"ground_truth": "42", "style": "rule"}}]
    ds = _dataset(tmp_path, tokenizer, rows, apply_chat_template=False, ground_truth_key="reward_model.ground_truth")
    assert ds[0]["ground_truth"] == "42"


def test_missing_file_raises_naming_the_path(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="absent.parquet' does not exist"):
        PromptDataset(DataConfig(files=[str(tmp_path / "absent.parquet")]), tokenizer)


def test_empty_file_list_and_unsupported_type_raise(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="DataConfig.files is empty"):
        PromptDataset(DataConfig(), tokenizer)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        PromptDataset(DataConfig(files=[str(tmp_path / "d.csv")]), tokenizer)


def test_missing_prompt_column_names_column_file_and_columns_present(tmp_path, tokenizer):
    path = _write(tmp_path, [{"question": "x", "ground_truth": "1"}])
    with pytest.raises(ValueError) as err:
        PromptDataset(DataConfig(files=[path]), tokenizer)
    msg = str(err.value)
    assert "'prompt'" in msg and "DataConfig.prompt_key" in msg and path in msg
    assert "['question', 'ground_truth']" in msg


def test_missing_ground_truth_column_names_the_field(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"'ground_truth' \(DataConfig.ground_truth_key"):
        PromptDataset(DataConfig(files=[path], apply_chat_template=False), tokenizer)
    ds = PromptDataset(DataConfig(files=[path], apply_chat_template=False, ground_truth_key=None), tokenizer)
    assert "ground_truth" not in ds[0]


@pytest.mark.parametrize("bad_prompt", [7, [], [{"role": "user"}], [{"role": "user", "content": 5}], "ok-but-next"])
def test_malformed_prompt_row_raises_naming_the_row(tmp_path, tokenizer, bad_prompt):
    rows = [{"prompt": "fine", "ground_truth": "1"}] * 2 + [{"prompt": bad_prompt, "ground_truth": "1"}]
    if bad_prompt == "ok-but-next":  # a row missing the ground truth
        rows[2] = {"prompt": "x"}
    path = _write(tmp_path, rows, "rows.jsonl")
    with pytest.raises(ValueError, match=r"rows.jsonl row 2: "):
        PromptDataset(DataConfig(files=[path], apply_chat_template=True), tokenizer)


def test_chat_messages_with_chat_template_off_raise_naming_the_field(tmp_path, tokenizer):
    path = _write(tmp_path, _rows(2))
    with pytest.raises(ValueError, match="row 0: .*apply_chat_template is false"):
        PromptDataset(DataConfig(files=[path], apply_chat_template=False), tokenizer)


def test_malformed_jsonl_line_raises_naming_the_line(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "ground_truth": "1"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match="broken.jsonl line 2: invalid JSON"):
        PromptDataset(DataConfig(files=[str(path)]), tokenizer)


def test_config_rejects_unknown_truncation_mode():
    with pytest.raises(ValueError, match="DataConfig.truncation must be one of"):
        DataConfig(truncation="both")


# ---------------------------------------------------------------- truncation and filtering


LONG = [{"prompt": "abcdefghij", "ground_truth": "1"}, {"prompt": "xy", "ground_truth": "2"}]


@pytest.mark.parametrize("mode,expected", [("left", "efghij"), ("right", "abcdef"), ("middle", "abchij")])
def test_truncation_modes_keep_the_expected_tokens(tmp_path, tokenizer, mode, expected):
    ds = _dataset(tmp_path, tokenizer, LONG, apply_chat_template=False, max_prompt_tokens=6, truncation=mode)
    assert tokenizer.decode(ds[0]["input_ids"]) == expected
    assert tokenizer.decode(ds[1]["input_ids"]) == "xy"


def test_truncation_error_raises_naming_row_and_length_vs_limit(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"row 0: prompt has 10 tokens > DataConfig.max_prompt_tokens=6"):
        _dataset(tmp_path, tokenizer, LONG, apply_chat_template=False, max_prompt_tokens=6, truncation="error")


def test_truncate_middle_with_odd_limit():
    assert truncate(list(range(10)), 5, "middle") == [0, 1, 2, 8, 9]


def test_filter_overlong_drops_prompts_and_logs_count(tmp_path, tokenizer, caplog):
    rows = LONG * 3
    with caplog.at_level(logging.INFO, logger="megarl.data.datasets"):
        ds = _dataset(tmp_path, tokenizer, rows, apply_chat_template=False, max_prompt_tokens=6, filter_overlong=True)
    assert len(ds) == 3 and ds.num_filtered == 3
    assert all(ds[i]["ground_truth"] == "2" for i in range(3))
    assert "filtered 3 of 6 prompts longer than max_prompt_tokens=6" in caplog.text


def test_max_samples_keeps_the_first_rows(tmp_path, tokenizer):
    assert len(_dataset(tmp_path, tokenizer, max_samples=4)) == 4


# ---------------------------------------------------------------- collation


def test_collate_left_pads_with_mask_and_positions(tmp_path, tokenizer):
    rows = [{"prompt": "abc", "ground_truth": "1"}, {"prompt": "a", "ground_truth": "2"}]
    ds = _dataset(tmp_path, tokenizer, rows, apply_chat_template=False)
    batch = collate_prompts([ds[0], ds[1]], tokenizer.pad_token_id)
    tensors, non_tensors = batch.tensors, batch.non_tensors
    pad = tokenizer.pad_token_id
    assert tensors["input_ids"].dtype == torch.long and tensors["input_ids"].shape == (2, 3)
    assert tensors["input_ids"][1, :2].tolist() == [pad, pad]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert tensors["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert isinstance(non_tensors["ground_truth"], np.ndarray) and non_tensors["ground_truth"].dtype == object
    assert non_tensors["ground_truth"].tolist() == ["1", "2"]


def test_collate_keeps_list_columns_as_objects(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(2))
    batch = collate_prompts([ds[0], ds[1]], tokenizer.pad_token_id)
    assert batch.non_tensors["raw_prompt"].shape == (2,)
    assert batch.non_tensors["raw_prompt"][1] == [{"role": "user", "content": "q1"}]
    assert batch.non_tensors["extra_info"][0] == {"index": 0}


# ---------------------------------------------------------------- the resumable loader


def _indices(batch):
    return batch.non_tensors["dataset_index"].tolist()


@pytest.mark.parametrize("steps_before_save", [2, 4, 3])  # mid-epoch, on the boundary, across it
def test_loader_resume_continues_at_the_same_next_sample(tmp_path, tokenizer, steps_before_save):
    ds = _dataset(tmp_path, tokenizer, _rows(10))
    uninterrupted = PromptLoader(ds, prompts_per_step=3, seed=7)
    expected = [_indices(uninterrupted.next_batch()) for _ in range(10)]

    first = PromptLoader(ds, prompts_per_step=3, seed=7)
    seen = [_indices(first.next_batch()) for _ in range(steps_before_save)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptLoader(ds, prompts_per_step=3, seed=7)
    resumed.load_state_dict(state)
    seen += [_indices(resumed.next_batch()) for _ in range(10 - steps_before_save)]
    assert seen == expected


def test_loader_resume_through_for_loop_across_epoch_boundary(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(10))
    loader = PromptLoader(ds, prompts_per_step=4, seed=1)
    expected = [_indices(b) for _ in range(3) for b in loader]
    loader2 = PromptLoader(ds, prompts_per_step=4, seed=1)
    seen = [_indices(b) for b in loader2]  # a whole epoch: 2 batches, 2 prompts dropped
    state = loader2.state_dict()
    loader3 = PromptLoader(ds, prompts_per_step=4, seed=1)
    loader3.load_state_dict(state)
    seen += [_indices(b) for _ in range(2) for b in loader3]
    assert seen == expected and len(seen) == 6 and state["epoch"] == 0


def test_loader_epochs_are_different_permutations_deterministic_in_seed(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(10))
    loader = PromptLoader(ds, prompts_per_step=5, seed=3)
    epoch0 = [i for b in loader for i in _indices(b)]
    epoch1 = [i for b in loader for i in _indices(b)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert PromptLoader(ds, 5, seed=3).order(1).tolist() == epoch1
    assert PromptLoader(ds, 5, seed=3, shuffle=False).order(0).tolist() == list(range(10))


def test_loader_drop_last_false_yields_partial_last_batch(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(10))
    loader = PromptLoader(ds, prompts_per_step=4, shuffle=False, drop_last=False)
    assert len(loader) == 3 and [len(_indices(b)) for b in loader] == [4, 4, 2]
    assert len(PromptLoader(ds, prompts_per_step=4)) == 2


def test_loader_state_from_other_data_or_seed_raises(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(10))
    state = PromptLoader(ds, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="saved seed=0 but this loader has 1"):
        PromptLoader(ds, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="saved num_prompts=10"):
        PromptLoader(_dataset(tmp_path, tokenizer, _rows(8)), 2).load_state_dict(state)


def test_loader_with_fewer_prompts_than_a_step_raises(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="has 10 prompts .* fewer than prompts_per_step=16"):
        PromptLoader(_dataset(tmp_path, tokenizer, _rows(10)), prompts_per_step=16)


def test_loader_from_config_uses_its_seed_and_shuffle(tmp_path, tokenizer):
    config = DataConfig(files=[_write(tmp_path, _rows(6))], seed=5, shuffle=False)
    loader = PromptLoader.from_config(PromptDataset(config, tokenizer), config, prompts_per_step=3)
    assert _indices(loader.next_batch()) == [0, 1, 2]


# ---------------------------------------------------------------- preprocessing scripts


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preprocess_gsm8k_writes_prompts_with_final_answer(tmp_path, tokenizer):
    raw = [
        {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
        {"question": "Big?", "answer": "#### 1,200"},
    ]
    src = _write(tmp_path, raw, "train.jsonl")
    out = _script("preprocess_gsm8k").main(["--input", src, "--out", str(tmp_path / "out")])
    assert out.endswith("train.parquet")
    ds = PromptDataset(DataConfig(files=[out], max_prompt_tokens=256), tokenizer)
    assert [ds[i]["ground_truth"] for i in range(2)] == ["5", "1200"]
    assert ds[0]["data_source"] == "gsm8k" and "####" in ds[0]["raw_prompt"][0]["content"]


def test_preprocess_gsm8k_row_without_final_answer_raises_naming_row(tmp_path):
    src = _write(tmp_path, [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no marker"}], "t.jsonl")
    with pytest.raises(ValueError, match="row 1: answer has no '#### N'"):
        _script("preprocess_gsm8k").main(["--input", src, "--out", str(tmp_path / "out")])


def test_preprocess_math_takes_last_boxed_and_skips_unboxed(tmp_path, tokenizer):
    raw = [
        {"problem": "Half?", "solution": r"It is $\boxed{\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
        {"problem": "None?", "solution": "no box here"},
    ]
    src = _write(tmp_path, raw, "test.parquet")
    out = _script("preprocess_math").main(["--input", src, "--out", str(tmp_path / "out"), "--split", "eval"])
    ds = PromptDataset(DataConfig(files=[out], max_prompt_tokens=256), tokenizer)
    assert len(ds) == 1 and ds[0]["ground_truth"] == r"\frac{1}{2}" and ds[0]["data_source"] == "math"
    assert ds[0]["extra_info"]["level"] == "Level 1" and out.endswith("eval.parquet")


def test_prompt_batches_are_rollout_batches_with_the_files_columns(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, _rows(4))
    batch = PromptLoader(ds, prompts_per_step=4, shuffle=False).next_batch()
    assert len(batch) == 4 and batch.schema.name == "rollout" and "extra_info" in batch.schema.columns
    with pytest.raises(KeyError, match="did you mean 'old_log_probs'"):
        batch["old_logprobs"] = torch.zeros(4, 3)
    assert torch.equal(batch["attention_mask"][:, -1], torch.ones(4, dtype=torch.long))
    assert list(batch["ground_truth"]) == ["0", "1", "2", "3"]
