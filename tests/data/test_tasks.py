import importlib.util
import json
import os

import pytest

from megarl.data.datasets import DataConfig, PromptDataset, PromptLoader
from megarl.data.tasks import make_arithmetic_dataset, make_countdown_dataset, make_task_dataset
from megarl.data.tokenizer import build_tiny_tokenizer
from megarl.rewards import RewardConfig, RewardRunner, get_reward_fn
from megarl.rewards.tasks import evaluate_equation, extract_equation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arithmetic_rows_have_prompt_ground_truth_and_data_source():
    rows = make_arithmetic_dataset(50, seed=0)
    assert all(r["data_source"] == "arithmetic" for r in rows)
    for r in rows:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert r["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
        assert r["ground_truth"] == str(a + b) and 0 <= a <= 4 and 0 <= b <= 4


def test_arithmetic_generation_is_deterministic_in_seed():
    assert make_arithmetic_dataset(20, seed=1) == make_arithmetic_dataset(20, seed=1)
    assert make_arithmetic_dataset(20, seed=1) != make_arithmetic_dataset(20, seed=2)


def test_arithmetic_other_ops_and_raw_prompts():
    rows = make_arithmetic_dataset(30, seed=0, max_operand=20, ops=("-", "*"), chat=False)
    for r in rows:
        a, b, op = r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["op"]
        assert r["prompt"] == f"{a}{op}{b}=" and int(r["ground_truth"]) == (a - b if op == "-" else a * b)
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        make_arithmetic_dataset(1, ops=("/",))


@pytest.mark.parametrize(
    "response,score,acc",
    [
        ("7", 1.0, 1.0),
        (" 7\n", 1.0, 1.0),
        ("3+4=7", 0.9, 1.0),
        ("The answer is 7.", 0.9, 1.0),
        ("8", 0.0, 0.0),
        ("6666", 0.0, 0.0),
        ("seven", 0.0, 0.0),
        ("7 is it? no, 8", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_arithmetic_reward_correct_incorrect_and_verbose(response, score, acc):
    out = get_reward_fn("arithmetic")(response, "7", {})
    assert out["score"] == pytest.approx(score) and out["acc"] == acc


def test_arithmetic_reward_verbose_penalty_from_extra_and_negative_answers():
    assert get_reward_fn("arithmetic")("so 7", "7", {"verbose_penalty": 0.0})["score"] == 1.0
    assert get_reward_fn("arithmetic")("-8", "-8", {})["score"] == 1.0


def test_countdown_every_generated_solution_scores_one():
    rows = make_countdown_dataset(40, seed=0, num_numbers=3)
    fn = get_reward_fn("countdown")
    for r in rows:
        truth = json.loads(r["ground_truth"])
        assert 0 < truth["target"] <= 99 and len(truth["numbers"]) == 3
        assert r["data_source"] == "countdown" and "<answer>" in r["prompt"][0]["content"]
        assert fn(f"think...<answer>{r['extra_info']['solution']}</answer>", r["ground_truth"], {})["score"] == 1.0


TRUTH = json.dumps({"target": 24, "numbers": [4, 4, 8]})


@pytest.mark.parametrize(
    "response,score",
    [
        ("<answer>8+4*4</answer>", 1.0),
        ("<answer>(8 + 4*4) = 24</answer>", 1.0),
        ("<answer>4*4+8</answer> trailing", 1.0),
        ("<answer>8*4-4-4</answer>", 0.1),  # a number used twice
        ("<answer>8*4-8</answer>", 0.1),  # 8 twice, 4 not at all
        ("<answer>4*4+4</answer>", 0.1),  # wrong value, wrong numbers
        ("<answer>8+4+4</answer>", 0.1),  # right numbers, wrong value
        ("<answer>8/(4-4)</answer>", 0.1),  # division by zero
        ("<answer>__import__('os')</answer>", 0.0),  # not an equation: never evaluated
        ("I give up", 0.0),
    ],
)
def test_countdown_reward_checks_numbers_and_target(response, score):
    assert get_reward_fn("countdown")(response, TRUTH, {})["score"] == score


def test_countdown_without_use_all_allows_a_subset_of_numbers():
    truth = json.dumps({"target": 12, "numbers": [3, 4, 9], "use_all": False})
    assert get_reward_fn("countdown")("<answer>3*4</answer>", truth, {})["score"] == 1.0


def test_countdown_equation_helpers():
    assert extract_equation("x\n<answer>1+2</answer>\n<answer>(3*4)</answer>") == "(3*4)"
    assert extract_equation("last line: no\n3 * 5 = 15") == "3 * 5"
    assert evaluate_equation("7/2*2") == 7 and evaluate_equation("2**10") is None


def test_tool_arithmetic_rows_pick_the_tool_agent_and_score_only_the_final_turn():
    rows = make_task_dataset("tool_arithmetic", 20, seed=3)
    assert rows == make_task_dataset("tool_arithmetic", 20, seed=3)
    for row in rows:
        a, b = row["extra_info"]["expression"].split("*")
        assert len(a) == 3 and len(b) == 2 and row["prompt"] == f"{a}*{b}="
        assert row["ground_truth"] == str(int(a) * int(b)) and row["agent_name"] == "tool_agent"
        assert len(row["ground_truth"]) == 5  # full width: every answer copied from the tool has one length
    narrow = make_task_dataset("tool_arithmetic", 200, seed=3, full_width=False)
    assert {len(row["ground_truth"]) for row in narrow} == {4, 5}
    reward, truth = get_reward_fn("tool_arithmetic"), rows[0]["ground_truth"]
    # the tool's result sits in the response text; only the model's final turn counts
    text = f"<tool_call>...</tool_call>\ntool\n{truth}\nassistant\n"
    assert reward(text, truth, {"final_response": ""})["acc"] == 0.0
    assert reward(text + truth, truth, {"final_response": truth}) == {"score": 1.0, "acc": 1.0}
    assert reward(truth, truth, {})["acc"] == 1.0  # without the loop's extras: the whole response
    with pytest.raises(ValueError, match="digits"):
        make_task_dataset("tool_arithmetic", 1, digits=(3,))


def test_unknown_task_raises_listing_tasks():
    with pytest.raises(
        ValueError, match=r"unknown task 'sudoku'; tasks: \['arithmetic', 'countdown', 'tool_arithmetic'\]"
    ):
        make_task_dataset("sudoku", 3)


def test_make_task_data_script_writes_train_and_test_that_load_and_score(tmp_path):
    spec = importlib.util.spec_from_file_location("make_task_data", os.path.join(ROOT, "scripts", "make_task_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    paths = module.main(["--task", "arithmetic", "--n", "200", "--out", str(tmp_path)])
    tokenizer = build_tiny_tokenizer()
    train = PromptDataset(DataConfig(files=[paths["train"]], max_prompt_tokens=64), tokenizer)
    test = PromptDataset(DataConfig(files=[paths["test"]], max_prompt_tokens=64), tokenizer)
    assert (len(train), len(test)) == (180, 20)
    batch = PromptLoader(train, prompts_per_step=8).next_batch()
    cols = batch.non_tensors
    runner = RewardRunner(RewardConfig(num_workers=0))
    correct = runner.score(list(cols["ground_truth"]), cols["ground_truth"], cols["data_source"])
    assert all(r["score"] == 1.0 for r in correct)
