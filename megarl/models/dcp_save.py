"""megatron-core's torch_dist writer, as megarl's synchronous saves use it (conversion, engine checkpoints).

Owns: `save()`, every megarl save's call of `dist_checkpointing.save`; `save_strategy()`, the one
`TorchDistSaveShardedStrategy` it passes; and three fixes:

* **A view of a larger tensor is written without a copy.** megatron-core's writer clones every CPU
  tensor whose storage is larger than itself (`torch.save` would write the whole storage): the two
  halves of each SwiGLU `linear_fc1`, and in a trainer every parameter that lives in DDP's contiguous
  buffer. `save()` hands it a contiguous view as a tensor of its own storage over the same memory
  instead. The clone's page faults cost this VM 0.3–2.0 s of system time per 475 MiB save (145 MiB of
  copies; `benchmarks/convert_throughput.py`'s model); without them its TP1 save took 0.51–0.54 s against
  0.59–1.55 s (`/work/scratch/s38/save_ab.py`, 3 alternating rounds). Only for synchronous saves: the
  writing thread reads the memory the model owns, so nothing may change it until `save()` returns.

* **The write-results queue is an in-process `queue.Queue`.** megatron-core makes it, on a process's
  first save, as `multiprocessing.get_context("spawn").Manager().Queue()`: a manager process that imports
  the caller's `__main__` (torch included) before the first save can finish — 2.5 s of a 4 s save of a
  475 MiB model (`benchmarks/convert_throughput.py`), paid by every conversion and by each trainer rank's
  first checkpoint. A synchronous save writes and reads that queue in this process. Installed only where
  megatron-core has made none yet.
* **The writer threads run at the same time.** With `thread_count=N` the writer splits a rank's tensors
  into N files; `write_preloaded_data_multithread` (megatron-core 0.19.2) creates a thread for each file
  but the last, writes the last one on the calling thread, and only then starts the threads: the N
  files are written one after another. `_write_buckets_in_parallel` starts each thread as it is created.
  A rank's 475 MiB (fp32, 2 files) saved in 0.40 s instead of 0.85 s (median of 4, alternating, one
  process, this 2-core VM: `/work/scratch/s36/save_ab.py`). Installed only on the megatron-core versions
  whose writer was read (`CHECKED_MCORE_VERSIONS`); on others megatron-core's own writer runs.
"""

from __future__ import annotations

import queue
import threading

import torch

CHECKED_MCORE_VERSIONS = ("0.19.2",)
WRITER_THREADS = 2
"""Files (and threads) per rank and save: 2 halves a save against 1 here; 3 gained 12% more on 2 cores."""


def save(sharded_state_dict: dict, directory) -> None:
    """`dist_checkpointing.save` of `sharded_state_dict` (built for this call: its factories are applied
    in place) into `directory`, synchronously, through `save_strategy()`; no tensor is copied."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    def write_in_place(item):
        if isinstance(item, ShardedTensor):
            item.data = own_storage(item.data)
        return item

    apply_factories(sharded_state_dict)
    dict_list_map_inplace(write_in_place, sharded_state_dict)
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=save_strategy())


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself unless it is a contiguous CPU view of a larger storage; then the same memory as a
    tensor whose storage is exactly its bytes (no copy), which megatron-core's writer does not clone."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()  # numpy has no bfloat16: bytes, then dtype
    return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)


def save_strategy(thread_count: int = WRITER_THREADS):
    """megatron-core's torch_dist writer for a synchronous save (`dist_checkpointing.save` without
    `async_sharded_save`): `thread_count` files per rank, written at the same time."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    _install_parallel_writers(filesystem_async.FileSystemWriterAsync)
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)


def _install_parallel_writers(writer_cls) -> None:
    from megatron_patches import installed_mcore_version

    current = writer_cls.__dict__["write_preloaded_data_multithread"]
    if current.__func__ is _write_buckets_in_parallel or installed_mcore_version() not in CHECKED_MCORE_VERSIONS:
        return
    writer_cls.write_preloaded_data_multithread = staticmethod(_write_buckets_in_parallel)


def _write_buckets_in_parallel(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """`FileSystemWriterAsync.write_preloaded_data_multithread` with its threads running together: every
    file but the last on a thread started at once, the last on the calling thread. Puts on
    `global_results_queue` what megatron-core's version puts there: {file index: its write results}, or
    the first worker's exception (which `retrieve_write_results` raises as a worker failure)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import _disable_gc
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data
    extra = {"use_msc": True} if use_msc else {}
    outputs: list = []  # (file index, results or exception); list.append is atomic

    def write_file(index: int, bucket) -> None:
        try:
            done = write(
                transform_list,
                local_proc_idx=index,
                write_bucket=bucket,
                results_queue=None,
                count_queue=None,
                use_fsync=True,
                **extra,
            )
            outputs.append(done)
        except Exception as err:  # write_preloaded_data returns its own errors; anything else lands here
            outputs.append((index, err))

    with _disable_gc():  # as megatron-core's writer: a collection during the writes can break shared CUDA tensors
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
