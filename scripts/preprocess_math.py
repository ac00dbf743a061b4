#!/usr/bin/env python
"""Convert raw MATH rows (`problem`, `solution` with a final `\\boxed{...}`) into a megarl prompt file.

    python scripts/preprocess_math.py --input math/test.jsonl --out data/math
    -> data/math/test.parquet with columns prompt (chat messages), ground_truth (the content of
       the solution's last \\boxed{}), data_source ("math"), extra_info {split, index, level, type}

Rows whose solution has no `\\boxed{}` are skipped and counted. Reads .jsonl, .json or .parquet.
"""

from __future__ import annotations

import argparse
import os
import sys

from megarl.data.datasets import load_rows, save_rows
from megarl.rewards.math_answer import extract_boxed

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def convert_row(row: dict, index: int, split: str) -> dict | None:
    """One raw MATH row -> one prompt row, or None when the solution has no `\\boxed{}` answer."""
    for key in ("problem", "solution"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"row {index}: MATH rows need a string {key!r}, got {row.get(key)!r}")
    ground_truth = extract_boxed(row["solution"])
    if ground_truth is None:
        return None
    extra = {"split": split, "index": index, "level": str(row.get("level", "")), "type": str(row.get("type", ""))}
    return {
        "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
        "ground_truth": ground_truth,
        "data_source": "math",
        "extra_info": extra,
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="raw MATH file (.jsonl, .json or .parquet)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", default=None, help="split name (default: the input file's stem)")
    args = parser.parse_args(argv)
    split = args.split or os.path.splitext(os.path.basename(args.input))[0]
    rows, _ = load_rows(args.input)
    converted = [convert_row(row, i, split) for i, row in enumerate(rows)]
    kept = [row for row in converted if row is not None]
    out_path = os.path.join(args.out, f"{split}.parquet")
    save_rows(kept, out_path)
    print(f"wrote {len(kept)} rows to {out_path} (skipped {len(rows) - len(kept)} without a \\boxed answer)")
    return out_path


if __name__ == "__main__":
    main(sys.argv[1:])
