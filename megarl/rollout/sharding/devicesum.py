"""Per-tensor checksums of a bucket on a GPU in one kernel launch (Triton); a bucket packed and summed in one.

Owns: `span_sums(words, spans)`, the GPU form of `protocol.checksums`' per-span sums: for each byte span
of a flat bucket, the wrapping int64 sum of the 8-byte words it touches. Torch needs a reduction per
tensor (launch-bound: hundreds of tensors per bucket) or about ten kernels and a host→device copy per
bucket (`protocol._blocked_sums`: block sums, then prefix sums). Here the spans are cut once per bucket
layout into pieces of at most `PIECE` words (a table kept on the device, `_pieces`), and one launch sums
every piece and adds it into its span's sum (`tl.atomic_add`: integer addition, so the order does not
matter and the result equals `words[span].sum()` bit for bit). One read of the bucket, one launch and a
zero fill per bucket.

`copy_sums(words, table, n)` packs a bucket and takes its checksums in the same pass: each segment is a
run of 8-byte words at some address (a parameter's rows) copied into the bucket, and the words are summed
per owner (the bucket's tensor they land in) as they are written — what `span_sums` would read back
afterwards, where every tensor begins and ends on a word (`pack.pack_bucket_summed`: the GPU's sharding
manager at TP 1, whose IPC sender then sums nothing).

`available()` is False without Triton or a CUDA device, with `MEGARL_TRITON_SUMS=0`, and after the kernel
failed to build or run once (logged as a warning, e.g. a GPU that Triton does not support; each kernel on its
own); callers then keep `protocol._blocked_sums`, or the pack its few launches. `TRITON_INTERPRET=1` (set before
Triton is imported) runs the same kernels on CPU tensors: the tests check them that way.
"""

from __future__ import annotations

import contextlib
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
_FAILED: dict[str, str] = {}  # kernel name → its first failure: that kernel is not tried again
logger = logging.getLogger(__name__)


def available(device: torch.device, kernel: str = "piece_sums") -> bool:
    """Whether `span_sums` (kernel "piece_sums") or `copy_sums` ("piece_copy_sums") runs on `device`'s tensors."""
    if os.environ.get("MEGARL_TRITON_SUMS", "1") == "0" or kernel in _FAILED:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _kernel(kernel) is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def readable(src: torch.Tensor, shape, like: torch.Tensor) -> bool:
    """Whether a kernel here may read `src` by its address as `shape` words of `like`'s dtype on its device: a
    plain tensor (a subclass, a DTensor or a quantized wrapper, may have no plain storage to read) of that shape,
    dtype and device, contiguous, on an 8-byte word (`copy_sums`' sources)."""
    if type(src) not in _PLAIN or tuple(src.shape) != tuple(shape) or src.dtype != like.dtype:
        return False
    return src.device == like.device and src.is_contiguous() and src.data_ptr() % 8 == 0


def span_sums(words: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Per (start, end) byte span, the int64 sum of the words of `words` (1-D int64, contiguous) it touches
    (from word start // 8 up to the one holding its last byte, cut at the end of `words`)."""
    kernel = _kernel("piece_sums")
    starts, counts, owners = _pieces(words.device, words.numel(), tuple(spans))
    sums = torch.zeros(len(spans), dtype=torch.int64, device=words.device)
    if starts.numel():
        with _on(words.device):
            kernel[(starts.numel(),)](words, starts, counts, owners, sums, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return sums


def copy_sums(words: torch.Tensor, table: tuple[torch.Tensor, ...], owners: int) -> torch.Tensor:
    """Copy every segment of `table` (`copy_table`) into `words` (1-D int64, contiguous, not overlapping a
    source); the per-owner int64 sums of the words written ([owners]), in one launch."""
    kernel = _kernel("piece_copy_sums")
    addresses, starts, counts, indices = table
    sums = torch.zeros(owners, dtype=torch.int64, device=words.device)
    if starts.numel():
        with _on(words.device):  # Triton launches on the current device; the table holds raw addresses
            kernel[(starts.numel(),)](addresses, words, starts, counts, indices, sums, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return sums


def copy_table(segments: list[tuple[int, int, int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The device table of `copy_sums` for segments (source byte address, first word of the destination, word
    count, owner index): each source 8-byte aligned memory of `device`, cut into pieces of at most `PIECE` words.
    The caller keeps it while the sources stay where they are (one host→device copy, not one per sync)."""
    rows = [
        (address + 8 * done, first + done, min(PIECE, count - done), owner)
        for address, first, count, owner in segments
        for done in range(0, count, PIECE)
    ]
    return tuple(torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int64)[: len(rows)].T.contiguous().to(device))


def disable(err: Exception, kernel: str = "piece_sums") -> None:
    """Stop using a kernel after it failed to build or run (`protocol._gpu_sums` and `pack.pack_bucket_summed`
    fall back to torch); the other one is still tried."""
    _FAILED.setdefault(kernel, f"{type(err).__name__}: {err}")
    what = "checksums" if kernel == "piece_sums" else "pack"
    logger.warning("one-launch GPU %s unavailable (%s); weight syncs use torch for it instead", what, _FAILED[kernel])


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


def _on(device: torch.device):
    """A context that makes `device` the current CUDA device where it is another GPU (Triton launches there)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    try:
        from megarl.rollout.sharding import sum_kernel
    except ImportError:
        return None
    return getattr(sum_kernel, name)
