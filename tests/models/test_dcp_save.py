"""megarl's torch_dist saves (`megarl.models.dcp_save`): a rank's files are written by threads running at
the same time, a writer's failure fails the save, and megatron-core versions nobody checked keep their
own writer."""

import pytest
import torch

from megarl.utils.distributed import RankError, run_distributed

FILES = 2
TENSORS = 8


def _state(fill: bool) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    def tensor(i):
        return torch.full((4096,), float(i)) if fill else torch.empty(4096)

    return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", tensor(i), replica_id=0) for i in range(TENSORS)}


def _save_with_writers_meeting(directory: str, failing_file: int = -1) -> dict:
    """A save in which every writer first waits until all `FILES` writers have started: it completes only
    if they run at the same time. The writer of file `failing_file` then raises instead of writing."""
    import threading

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megarl.models.dcp_save import save_strategy

    strategy = save_strategy(FILES)
    write = FileSystemWriterAsync.write_preloaded_data
    meet = threading.Barrier(FILES, timeout=10)

    def meeting_write(transform_list, **kwargs):  # megatron-core calls it with keywords
        meet.wait()
        if kwargs["local_proc_idx"] == failing_file:
            raise OSError("no space left on device (test)")
        return write(transform_list, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(meeting_write)
    try:
        dist_checkpointing.save(_state(fill=True), directory, sharded_strategy=strategy)
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    loaded = dist_checkpointing.load(_state(fill=False), directory)
    return {key: sorted(set(value.tolist())) for key, value in loaded.items()}


def test_a_ranks_files_are_written_at_the_same_time_and_load_back(tmp_path):
    # megatron-core 0.19.2's own writer starts its threads only after the calling thread wrote its file:
    # there the first writer waits for the others in vain and the save fails
    (loaded,) = run_distributed(_save_with_writers_meeting, 1, str(tmp_path), timeout=120)
    assert loaded == {f"w{i}": [float(i)] for i in range(TENSORS)}
    assert len(list(tmp_path.glob("*.distcp"))) == FILES


@pytest.mark.parametrize("failing_file", [0, FILES - 1], ids=["thread's-file", "calling-thread's-file"])
def test_a_writer_that_fails_fails_the_save_naming_the_error(tmp_path, failing_file):
    with pytest.raises(RankError, match="no space left on device"):
        run_distributed(_save_with_writers_meeting, 1, str(tmp_path), failing_file, timeout=120)


def test_an_unchecked_megatron_core_keeps_its_own_writer(monkeypatch):
    import megatron_patches
    from megarl.models import dcp_save

    def own(*args):
        return None

    writer = type("Writer", (), {"write_preloaded_data_multithread": staticmethod(own)})
    monkeypatch.setattr(megatron_patches, "installed_mcore_version", lambda: "0.99.0")
    dcp_save._install_parallel_writers(writer)
    assert writer.__dict__["write_preloaded_data_multithread"].__func__ is own
    monkeypatch.setattr(megatron_patches, "installed_mcore_version", lambda: dcp_save.CHECKED_MCORE_VERSIONS[0])
    dcp_save._install_parallel_writers(writer)
    assert writer.__dict__["write_preloaded_data_multithread"].__func__ is dcp_save._write_buckets_in_parallel
