#!/usr/bin/env python
"""Conversion + parity demo: a tiny Qwen2 model goes HF → megatron-core (TP2×PP2) → HF, exactly.

    python scripts/conversion_demo.py                  # into runs/conversion_demo
    python scripts/conversion_demo.py --out /tmp/demo --tp 1 --pp 1     # one GPU (scripts/gpu_check.sh)

Steps, each printed: build a tiny Qwen2 from a config (no download) and save it; check megatron
logits against transformers at TP2×PP2 (--tp/--pp); convert to a megatron distributed checkpoint at
that layout; convert back at TP1; compare every tensor bit for bit. One rank per GPU with CUDA. A rerun
replaces the demo's three directories under --out (hf, mcore, hf_roundtrip) and nothing else there.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.models.convert import hf_to_mcore, mcore_to_hf
from megarl.models.layout import ParallelLayout
from megarl.models.parity import check_parity
from megarl.testing.models import save_tiny_hf_model


def _tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/conversion_demo")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    for previous in ("hf", "mcore", "hf_roundtrip"):  # the last demo's; the rest of --out is not the demo's
        shutil.rmtree(out / previous, ignore_errors=True)
    layout = ParallelLayout(tp=args.tp, pp=args.pp)
    start = time.perf_counter()

    print(f"[1/4] tiny Qwen2 (2 layers, hidden 64, tied embeddings) → {out / 'hf'}")
    save_tiny_hf_model("qwen2", out / "hf")
    print(
        f"[2/4] parity megatron-core (tp={args.tp}, pp={args.pp}) vs transformers: {check_parity(out / 'hf', layout)}"
    )
    meta = hf_to_mcore(out / "hf", out / "mcore", layout)
    print(f"[3/4] HF → megatron-core distributed checkpoint {out / 'mcore'} ({meta['model_type']}, {meta['dtype']})")
    mcore_to_hf(out / "mcore", out / "hf_roundtrip")
    original, back = _tensors(out / "hf"), _tensors(out / "hf_roundtrip")
    exact = set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
    print(f"[4/4] megatron-core → HF {out / 'hf_roundtrip'}: {len(back)} tensors, bit-exact: {exact}")
    print(f"done in {time.perf_counter() - start:.0f}s")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
