"""The trainer must learn, not only run: a tiny policy with a known, fixable flaw goes through the real
`megarl train` (Ray, TP2 megatron-core actor in two gloo worker processes, weight sync to the rollout
engines) and its greedy validation accuracy must rise far beyond what a broken trainer can reach.

The flaw: single-digit sums ("3+4=" → "7"; 25 problems) warmed up on a teacher that answers one too
high 70% of the time. The warm-up policy knows the sums but greedily answers sum + 1 (accuracy ~0.2),
while about a third of its samples are right: GRPO on the exact-answer reward removes the habit in a
few steps (accuracy ~0.9 after 10). The response is the answer alone (one token: max_response_tokens=1,
no end-of-turn token), so a trainer that does not put the policy gradient on exactly that token learns
nothing. With room for the end-of-turn token (max_response_tokens=3) a response mask shifted by one
still learnt (0.2 -> 0.75 in 20 steps, the gradient on the end-of-turn token after the answer reaches
the answer indirectly), so the test would not have noticed that bug. Checked by hand (mutations not
shipped): the test fails with the advantage sign flipped, the response mask shifted by one token in
the actor loss, or lr=0.

Two variants, ~45 s each on 2 cores: the embedded rollout engine, and vLLM's CPU build.
"""

import pytest
import torch
from train_helpers import run_train

from megarl.rollout import vllm_available
from megarl.trainer.metrics import read_metrics, validation_summary, zero_variance_share

TEACHER_ERROR = 0.7
MIN_RISE = 0.4  # greedy validation accuracy, after - before: lr=0 gives exactly 0, a wrong sign < 0
MIN_FINAL = 0.6  # and the policy must end mostly right (the warm-up starts at ~0.2)


@pytest.fixture(scope="module")
def habit_task(tmp_path_factory):
    """{"model", "train", "test", "before"}: the warm-up policy (hidden 64, 2 heads of 32) with the habit."""
    from megarl.data.datasets import load_rows
    from megarl.data.tasks import write_task_splits
    from megarl.data.tokenizer import build_tiny_tokenizer
    from megarl.testing.models import save_tiny_policy
    from megarl.trainer.sft import greedy_answers, off_by_one_teacher, sft_examples, sft_warmup

    root = tmp_path_factory.mktemp("learning")
    tok = build_tiny_tokenizer()
    save_tiny_policy(root / "model", tok)
    paths = write_task_splits("arithmetic", 400, str(root / "data"), chat=False)
    train, test = (load_rows(paths[split])[0] for split in ("train", "test"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds sync
    try:
        sft_warmup(
            str(root / "model"),
            sft_examples(off_by_one_teacher(train, TEACHER_ERROR), tok),
            steps=200,
            batch_size=64,
            lr=3e-3,
            lr_decay=True,
        )
        answers = [
            tok.decode(a, skip_special_tokens=True)
            for a in greedy_answers(str(root / "model"), sft_examples(test, tok))
        ]
    finally:
        torch.set_num_threads(threads)
    right = sum(a == r["ground_truth"] for a, r in zip(answers, test)) / len(test)
    high = sum(a == str(int(r["ground_truth"]) + 1) for a, r in zip(answers, test)) / len(test)
    return {"model": str(root / "model"), **paths, "before": right, "off_by_one": high}


def test_warmup_leaves_the_teachers_habit(habit_task):
    """The premise of the learning tests: the policy starts mostly wrong, and wrong by exactly one."""
    assert habit_task["before"] <= 0.4 and habit_task["off_by_one"] >= 0.5, habit_task


def learning_run(task: dict, run_dir, engine: str) -> list[dict]:
    args = [
        f"model.hf_path={task['model']}",
        f"data.files=[{task['train']}]",
        f"validation.files=[{task['test']}]",
        f"rollout.engine={engine}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=20",
        "trainer.prompts_per_step=16",
        "rollout.samples_per_prompt=8",
        "rollout.max_response_tokens=1",
        "data.max_prompt_tokens=8",
        "validation.every_steps=10",
        "trainer.export_hf_at_end=false",
        "trainer.dump_rollouts_every_steps=0",
        "trainer.progress_bar=false",
    ]
    code, out, seconds = run_train("grpo_quickstart.yaml", args)
    assert code == 0, out[-4000:]
    print(f"learning run ({engine}): {seconds:.0f} s")
    return read_metrics(run_dir / "metrics.jsonl")


def assert_learnt(rows: list[dict]) -> None:
    (_, _, before), (last, _, after) = validation_summary(rows)
    curve = [(r["step"], round(r["val/acc"], 3)) for r in rows if "val/acc" in r]
    assert last == 20 and after - before >= MIN_RISE and after >= MIN_FINAL, curve
    train = [r["reward/acc"] for r in rows if "reward/acc" in r]
    assert sum(train[-5:]) / 5 - sum(train[:5]) / 5 >= 0.05, train  # the sampled answers improve too (~+0.2)


def test_grpo_learns_to_drop_the_habit_with_the_embedded_engine(habit_task, tmp_path):
    assert_learnt(learning_run(habit_task, tmp_path / "embedded", "embedded"))


@pytest.mark.skipif(not vllm_available(), reason="vLLM (CPU build) is not installed")
def test_grpo_learns_to_drop_the_habit_with_vllm(habit_task, tmp_path):
    assert_learnt(learning_run(habit_task, tmp_path / "vllm", "vllm"))


def test_zero_variance_share_counts_groups_whose_samples_all_scored_the_same():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_share(scores, ["a", "a", "b", "b", "c", "c"]) == pytest.approx(2 / 3)
    assert zero_variance_share(scores[:2], ["a", "b"]) == 1.0
