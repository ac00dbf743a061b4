"""megatron-core's torch_dist writer, as megarl's saves use it (conversion, engine checkpoints, asynchronous ones).

Owns: `save()`, every megarl save's call of `dist_checkpointing.save`, and `save_async()`, the same save
with this rank's files written on a thread of this process (`PendingSave`: the tensors copied first, the
request finalized by a collective `finish()`); `save_strategy()`, the one `TorchDistSaveShardedStrategy`
they pass; and these fixes:

* **A view of a larger tensor is written without a copy.** megatron-core's writer clones every CPU
  tensor whose storage is larger than itself (`torch.save` would write the whole storage): the two
  halves of each SwiGLU `linear_fc1`, and in a trainer every parameter that lives in DDP's contiguous
  buffer. `save()` hands it a contiguous view as a tensor of its own storage over the same memory
  instead. The clone's page faults cost this VM 0.3–2.0 s of system time per 475 MiB save (145 MiB of
  copies; `benchmarks/convert_throughput.py`'s model); without them its TP1 save took 0.51–0.54 s against
  0.59–1.55 s (`/work/scratch/s38/save_ab.py`, 3 alternating rounds). A synchronous save's writing
  threads read the memory the model owns, so nothing may change it until `save()` returns; an asynchronous
  one writes from its copies (`snapshot`).

* **The write-results queue is an in-process `queue.Queue`.** megatron-core makes it, on a process's
  first save, as `multiprocessing.get_context("spawn").Manager().Queue()`: a manager process that imports
  the caller's `__main__` (torch included) before the first save can finish — 2.5 s of a 4 s save of a
  475 MiB model (`benchmarks/convert_throughput.py`), paid by every conversion and by each trainer rank's
  first checkpoint. A save writes and reads that queue in this process; each save gets a fresh one (a
  save of another engine of the process may still be writing on a thread: `save_async`).
* **The writer threads run at the same time.** With `thread_count=N` the writer splits a rank's tensors
  into N files; `write_preloaded_data_multithread` (megatron-core 0.19.2) creates a thread for each file
  but the last, writes the last one on the calling thread, and only then starts the threads: the N
  files are written one after another. `_write_buckets_in_parallel` starts each thread as it is created.
  A rank's 475 MiB (fp32, 2 files) saved in 0.40 s instead of 0.85 s (median of 4, alternating, one
  process, this 2-core VM: `/work/scratch/s36/save_ab.py`). Installed only on the megatron-core versions
  whose writer was read (`CHECKED_MCORE_VERSIONS`); on others megatron-core's own writer runs.
* **A file is written behind: what is on disk leaves the page cache** (`megarl.utils.write_behind`).
  Each writer thread writes through a `WriteBehindFile`, which syncs and drops every 16 MiB it wrote: a
  save fills the cache with at most that much per file, and on this VM keeps reusing its own freed pages
  (fresh pages cost ~3 µs each to touch: 1.2–1.5 s of system time per 475 MiB, against 0.15 s).
* **No CRC32 per zip record** (`_no_zip_checksums`), which torch.load never checks.

With the last two, `benchmarks/convert_throughput.py`'s TP1 save took 0.72–0.74 s against 1.08–1.26 s
(TP2 0.52–0.60 against 0.96–1.10 s; 3 alternating pairs against the commit before them).
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
from typing import Iterable

import torch

from megarl.utils.faults import hold
from megarl.utils.write_behind import WriteBehindFile

CHECKED_MCORE_VERSIONS = ("0.19.2",)
WRITER_THREADS = 2
"""Files (and threads) per rank and save: 2 halves a save against 1 here; 3 gained 12% more on 2 cores."""


def save(sharded_state_dict: dict, directory) -> None:
    """`dist_checkpointing.save` of `sharded_state_dict` (built for this call: its factories are applied
    in place) into `directory`, synchronously, through `save_strategy()`; no contiguous tensor is copied."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_in_place(sharded_state_dict), str(directory), sharded_strategy=save_strategy())


def save_async(sharded_state_dict: dict, directory, live: Iterable[torch.Tensor] = ()) -> "PendingSave":
    """`save`, with this rank's files written on a thread: returns once the save is planned (collective) and
    its tensors are copied where the caller could change them (`snapshot`; `live`: the tensors the caller goes
    on changing, its model's and optimizer's). `PendingSave.finish()` (collective) completes it."""
    from megatron.core import dist_checkpointing

    request = dist_checkpointing.save(
        _in_place(sharded_state_dict),
        str(directory),
        sharded_strategy=save_strategy(),
        async_sharded_save=True,
        async_strategy="mcore",  # megatron-core's own request; megarl runs it (NVRx's is an extra package)
    )
    return PendingSave(request, live)


class PendingSave:
    """A rank's share of an asynchronous torch_dist save: its files being written by a thread of this process.

    megatron-core's `AsyncRequest` is run the way `AsyncRequest.execute_sync` runs it, but its write on a
    thread: `written()` says whether this rank's files are on disk; `finish()`, called by every rank of the
    save at the same point, waits for them and runs the request's finalization (the write results gathered,
    `.metadata` and `metadata.json` written by rank 0; a failed write on any rank raises on every rank).
    """

    def __init__(self, request, live: Iterable[torch.Tensor] = ()):
        self.request = request
        args = list(request.async_fn_args)
        if request.async_fn is not None:
            args[1] = snapshot(args[1], live)  # the write buckets: from here on the caller may change `live`
        self.thread = threading.Thread(target=self._write, args=(args,), name="megarl-checkpoint", daemon=True)
        self.thread.start()

    def _write(self, args) -> None:
        if self.request.async_fn is None:
            return
        hold("checkpoint.write")  # fault injection: an asynchronous checkpoint being written
        try:
            self.request.async_fn(*args, **self.request.async_fn_kwargs)
        except Exception as err:  # noqa: BLE001 — reported by `finish` on every rank, as a failed file write is
            args[2].put(err)

    def written(self) -> bool:
        return not self.thread.is_alive()

    def finish(self) -> None:
        self.thread.join()
        for finalize in self.request.finalize_fns:
            finalize()


def snapshot(write_buckets: list, live: Iterable[torch.Tensor] = ()) -> list:
    """megatron-core's write buckets with every tensor the caller may change copied: a CUDA tensor to host
    memory (megatron-core's `preload_tensors`: non-blocking, then one synchronize), a CPU tensor that shares
    memory with one of `live` cloned (megatron-core's own asynchronous writer is a forked process, whose
    memory is its snapshot; a thread has none). CPU tensors the save built for itself (a distributed
    optimizer's state gathered into new buffers: most of a checkpoint) are written as they are."""
    spans = _memory_spans(live)
    copied, on_gpu = [], False
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = []
        for item, tensor in tensor_data:
            if tensor.device.type == "cuda":
                on_gpu, tensor = True, tensor.to("cpu", non_blocking=True)
            elif _overlaps(tensor, spans):
                tensor = tensor.clone()
            tensors.append((item, tensor))
        copied.append((file_name, storage_key, (bytes_data, tensors)))
    if on_gpu:
        torch.cuda.synchronize()
    return copied


def _memory_spans(tensors: Iterable[torch.Tensor]) -> tuple[list[int], list[int]]:
    """The host memory of `tensors`' storages as sorted, merged [start, end) spans: (starts, ends)."""
    spans = sorted(
        (s.data_ptr(), s.data_ptr() + s.nbytes())
        for s in (t.untyped_storage() for t in tensors if t.device.type == "cpu")
        if s.nbytes()
    )
    starts, ends = [], []
    for start, end in spans:
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _overlaps(tensor: torch.Tensor, spans: tuple[list[int], list[int]]) -> bool:
    starts, ends = spans
    if tensor.numel() == 0:
        return False
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))  # elements
    first, last = tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size()
    i = bisect.bisect_right(starts, last - 1) - 1  # the last span starting before this tensor ends
    return i >= 0 and ends[i] > first


def _in_place(sharded_state_dict: dict) -> dict:
    """`sharded_state_dict` with its factories applied and every contiguous CPU view as a tensor of its own
    storage (`own_storage`), in place."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    def write_in_place(item):
        if isinstance(item, ShardedTensor):
            item.data = own_storage(item.data)
        return item

    apply_factories(sharded_state_dict)
    dict_list_map_inplace(write_in_place, sharded_state_dict)
    return sharded_state_dict


@contextlib.contextmanager
def _no_zip_checksums():
    """torch.save without the CRC32 of each zip record: torch.load never checks it (a flipped byte in a
    record loads silently either way) and nothing reads a .distcp file as a zip archive; it cost 0.1 s of a
    0.5 s save of 475 MiB here. torch's config overrides are thread-local: this thread's only."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself unless it is a contiguous CPU view of a larger storage; then the same memory as a
    tensor whose storage is exactly its bytes (no copy), which megatron-core's writer does not clone."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()  # numpy has no bfloat16: bytes, then dtype
    return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)


def save_strategy(thread_count: int = WRITER_THREADS):
    """megatron-core's torch_dist writer for megarl's saves (`save`, and `save_async`'s request): `thread_count`
    files per rank, written at the same time."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    filesystem_async._results_queue = queue.Queue()  # this save's own: one may be written on a thread meanwhile
    _install_parallel_writers(filesystem_async.FileSystemWriterAsync)
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)


def _write_file(transform_list, index: int, bucket) -> tuple:
    """megatron-core's `write_preloaded_data` for a local file, written behind (`WriteBehindFile`): each
    item through torch DCP's `_write_item` in torch.save format (`_no_zip_checksums`), then fsync. Returns
    (index, results)."""
    import inspect

    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

    file_name, storage_key, (bytes_data, tensor_data) = bucket
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        extra["serialization_format"] = SerializationFormat.TORCH_SAVE
    with _no_zip_checksums(), WriteBehindFile(file_name) as stream:
        results = [
            _write_item(*transform_list, stream, data, item, storage_key, **extra)
            for item, data in (*bytes_data, *tensor_data)
        ]
        stream.sync()
    return index, results


def _install_parallel_writers(writer_cls) -> None:
    from megatron_patches import installed_mcore_version

    current = writer_cls.__dict__["write_preloaded_data_multithread"]
    if current.__func__ is _write_buckets_in_parallel or installed_mcore_version() not in CHECKED_MCORE_VERSIONS:
        return
    writer_cls.write_preloaded_data_multithread = staticmethod(_write_buckets_in_parallel)


def _write_buckets_in_parallel(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """`FileSystemWriterAsync.write_preloaded_data_multithread` with its threads running together: every
    file but the last on a thread started at once, the last on the calling thread; a local file written
    behind (`_write_file`), a multi-storage-client one by megatron-core's own writer. Puts on
    `global_results_queue` what megatron-core's version puts there: {file index: its write results}, or
    the first worker's exception (which `retrieve_write_results` raises as a worker failure)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import _disable_gc
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data
    outputs: list = []  # (file index, results or exception); list.append is atomic

    def write_file(index: int, bucket) -> None:
        try:
            if use_msc:
                done = write(transform_list, index, bucket, None, None, use_fsync=True, use_msc=True)
            else:
                done = _write_file(transform_list, index, bucket)
            outputs.append(done)
        except Exception as err:  # write_preloaded_data returns its own errors; anything else lands here
            outputs.append((index, err))

    # as megatron-core's writer (a collection during the writes can break shared CUDA tensors of its forked
    # writer process); not on an asynchronous save's thread, where it would stop the training thread's GC too
    no_gc = _disable_gc() if threading.current_thread() is threading.main_thread() else contextlib.nullcontext()
    with no_gc:
        threads = [threading.Thread(target=write_file, args=item) for item in enumerate(write_buckets[:-1])]
        for thread in threads:
            thread.start()
        try:
            if write_buckets:
                write_file(len(write_buckets) - 1, write_buckets[-1])
        finally:
            for thread in threads:
                thread.join()
    failed = [result for _, result in sorted(outputs, key=lambda o: o[0]) if isinstance(result, Exception)]
    global_results_queue.put(failed[0] if failed else dict(outputs))
