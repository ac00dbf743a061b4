"""Per-tensor checksums of a bucket on a GPU in one kernel launch (Triton).

Owns: `span_sums(words, spans)`, the GPU form of `protocol.checksums`' per-span sums: for each byte span
of a flat bucket, the wrapping int64 sum of the 8-byte words it touches. Torch needs a reduction per
tensor (launch-bound: hundreds of tensors per bucket) or about ten kernels and a host→device copy per
bucket (`protocol._blocked_sums`: block sums, then prefix sums). Here the spans are cut once per bucket
layout into pieces of at most `PIECE` words (a table kept on the device, `_pieces`), and one launch sums
every piece and adds it into its span's sum (`tl.atomic_add`: integer addition, so the order does not
matter and the result equals `words[span].sum()` bit for bit). One read of the bucket, one launch and a
zero fill per bucket.

`available()` is False without Triton or a CUDA device, with `MEGARL_TRITON_SUMS=0`, and after the kernel
failed to build or run once (logged as a warning, e.g. a GPU that Triton does not support); callers then keep
`protocol._blocked_sums`. `TRITON_INTERPRET=1` (set before Triton is imported) runs the same kernel
on CPU tensors: the tests check it that way.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict

import torch

PIECE = 1 << 16  # words per program: 512 KiB, ~2000 programs for a 1 GiB bucket
BLOCK = 1 << 10  # words per loop step of one program
NUM_WARPS = 4
_TABLES: OrderedDict = OrderedDict()  # (device, words, PIECE, spans) → its device table of pieces, newest last
_MAX_TABLES = 64
_FAILED: list[str] = []  # the kernel's first failure, if any: it is not tried again
logger = logging.getLogger(__name__)


def available(device: torch.device) -> bool:
    """Whether `span_sums` can run on `device`'s tensors."""
    if os.environ.get("MEGARL_TRITON_SUMS", "1") == "0" or _FAILED:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _kernel() is not None


def span_sums(words: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Per (start, end) byte span, the int64 sum of the words of `words` (1-D int64, contiguous) it touches
    (from word start // 8 up to the one holding its last byte, cut at the end of `words`)."""
    kernel = _kernel()
    starts, counts, owners = _pieces(words.device, words.numel(), tuple(spans))
    sums = torch.zeros(len(spans), dtype=torch.int64, device=words.device)
    if starts.numel():
        kernel[(starts.numel(),)](words, starts, counts, owners, sums, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return sums


def disable(err: Exception) -> None:
    """Stop using the kernel after it failed to build or run (`protocol._gpu_sums` falls back)."""
    _FAILED.append(f"{type(err).__name__}: {err}")
    logger.warning("one-launch GPU checksums unavailable (%s); weight syncs sum with torch instead", _FAILED[0])


def _pieces(device: torch.device, n: int, spans: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first word, word count, span index) of every piece of the spans, on the device; kept per bucket layout
    (buckets keep their layout from sync to sync, so the host→device copy happens once)."""
    key = (str(device), n, PIECE, spans)
    table = _TABLES.get(key)
    if table is None:
        rows = []
        for index, (start, end) in enumerate(spans):
            first, stop = start // 8, min(-(-end // 8), n)
            rows += [(at, min(PIECE, stop - at), index) for at in range(first, stop, PIECE)]
        packed = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64)[: len(rows)].T.contiguous().to(device)
        table = _TABLES[key] = tuple(packed)
        if len(_TABLES) > _MAX_TABLES:
            _TABLES.popitem(last=False)
    _TABLES.move_to_end(key)
    return table


@functools.lru_cache(maxsize=None)
def _kernel():
    try:
        from megarl.rollout.sharding.sum_kernel import piece_sums
    except ImportError:
        return None
    return piece_sums
