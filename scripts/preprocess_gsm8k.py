#!/usr/bin/env python
"""Convert raw GSM8K rows (`question`, `answer` ending in `#### N`) into a megarl prompt file.

    python scripts/preprocess_gsm8k.py --input gsm8k/train.jsonl --out data/gsm8k
    -> data/gsm8k/train.parquet with columns prompt (chat messages), ground_truth (N),
       data_source ("gsm8k"), extra_info {split, index, answer}

The split name is the input file's stem unless --split is given. Reads .jsonl, .json or .parquet.
"""

from __future__ import annotations

import argparse
import os
import sys

from megarl.data.datasets import load_rows, save_rows
from megarl.rewards.gsm8k import extract_gsm8k_answer

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def convert_row(row: dict, index: int, split: str) -> dict:
    """One raw GSM8K row -> one prompt row; raises naming the row when `answer` has no `#### N`."""
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"row {index}: GSM8K rows need a string {key!r}, got {row.get(key)!r}")
    ground_truth = extract_gsm8k_answer(row["answer"], mode="strict")
    if ground_truth is None:
        raise ValueError(f"row {index}: answer has no '#### N' final answer: {row['answer'][-80:]!r}")
    return {
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ground_truth": ground_truth,
        "data_source": "gsm8k",
        "extra_info": {"split": split, "index": index, "answer": row["answer"]},
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="raw GSM8K file (.jsonl, .json or .parquet)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", default=None, help="split name (default: the input file's stem)")
    args = parser.parse_args(argv)
    split = args.split or os.path.splitext(os.path.basename(args.input))[0]
    rows, _ = load_rows(args.input)
    out_path = os.path.join(args.out, f"{split}.parquet")
    save_rows([convert_row(row, i, split) for i, row in enumerate(rows)], out_path)
    print(f"wrote {len(rows)} rows to {out_path}")
    return out_path


if __name__ == "__main__":
    main(sys.argv[1:])
