#!/usr/bin/env python
"""Write train/test parquet files of a generated task (see megarl/data/tasks.py).

    python scripts/make_task_data.py --task arithmetic --n 2000 --out data/arithmetic
    python scripts/make_task_data.py --task countdown --n 5000 --out data/countdown --num-numbers 3

Extra flags are passed to the task's generator (arithmetic: --max-operand, --ops;
countdown: --num-numbers, --max-number, --max-target); --raw writes raw-string prompts
instead of chat messages.
"""

from __future__ import annotations

import argparse
import sys

from megarl.data.tasks import TASKS, write_task_splits


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--n", type=int, default=2000, help="rows in train + test")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--raw", action="store_true", help="raw-string prompts instead of chat messages")
    parser.add_argument("--max-operand", type=int, help="arithmetic: largest operand")
    parser.add_argument("--ops", help="arithmetic: operators, e.g. '+-*'")
    parser.add_argument("--num-numbers", type=int, help="countdown: numbers per problem")
    parser.add_argument("--max-number", type=int, help="countdown: largest number")
    parser.add_argument("--max-target", type=int, help="countdown: largest target")
    args = parser.parse_args(argv)
    kwargs = {k: v for k, v in vars(args).items() if k in _TASK_FLAGS[args.task] and v is not None}
    if "ops" in kwargs:
        kwargs["ops"] = tuple(kwargs["ops"])
    paths = write_task_splits(
        args.task, args.n, args.out, seed=args.seed, test_fraction=args.test_fraction, chat=not args.raw, **kwargs
    )
    print(f"wrote {paths['train']} and {paths['test']}")
    return paths


_TASK_FLAGS = {"arithmetic": {"max_operand", "ops"}, "countdown": {"num_numbers", "max_number", "max_target"}}

if __name__ == "__main__":
    main(sys.argv[1:])
