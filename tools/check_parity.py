#!/usr/bin/env python
"""Compare a megatron-core model built from an HF checkpoint with `transformers` on the same tokens.

    python tools/check_parity.py --hf-path HF_DIR --tp 2 --pp 2 [--atol 1e-4]

Prints the max |Δlogit| and whether it is within tolerance (exit code 1 when it is not).
Same as `megarl check-parity ...`.
"""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["check-parity", *sys.argv[1:]]))
