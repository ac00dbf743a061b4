#!/usr/bin/env python
"""Convert checkpoints between HuggingFace and megatron-core at any TP/PP/VPP(/EP) layout.

    python tools/convert_checkpoint.py hf-to-mcore --hf-path HF_DIR --mcore-path OUT --tp 2 --pp 2
    python tools/convert_checkpoint.py mcore-to-hf --mcore-path CKPT --hf-path OUT
    torchrun --nproc-per-node 4 tools/convert_checkpoint.py hf-to-mcore ... --tp 2 --pp 2
    python tools/convert_checkpoint.py hf-to-mcore --hf-path MIXTRAL_DIR --mcore-path OUT --tp 2 --ep 2

Single-process runs spawn the tp*pp*ep ranks they need (EP is carved out of data parallelism);
under torchrun the world size must be a multiple of tp*pp, with ep dividing the DP size. Same as
`megarl convert ...`.
"""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
