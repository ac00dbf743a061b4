"""megarl's torch_dist saves (`megarl.models.dcp_save`): a rank's files are written by threads running at
the same time, a writer's failure fails the save, megatron-core versions nobody checked keep their own
writer, contiguous views are written without copies, and files are written behind (synced, then dropped
from the page cache) without zip checksums, loading back as saved."""

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

    from megarl.models import dcp_save

    strategy = dcp_save.save_strategy(FILES)
    write = dcp_save._write_file
    meet = threading.Barrier(FILES, timeout=10)

    def meeting_write(transform_list, index, bucket):
        meet.wait()
        if index == failing_file:
            raise OSError("no space left on device (test)")
        return write(transform_list, index, bucket)

    dcp_save._write_file = meeting_write
    try:
        dist_checkpointing.save(_state(fill=True), directory, sharded_strategy=strategy)
    finally:
        dcp_save._write_file = write
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


def _save_views(directory: str) -> tuple:
    """Saves two contiguous halves of one tensor and a strided view through `dcp_save.save`, counting
    the tensors cloned meanwhile; returns (numels cloned, whether each loads back as saved)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megarl.models import dcp_save

    whole = torch.arange(2 * 4096, dtype=torch.float32).view(2, 4096)
    views = {"top": whole[0], "bottom": whole[1], "strided": torch.arange(2 * 4096.0).view(4096, 2)[:, 1]}
    expected = {name: view.clone() for name, view in views.items()}
    cloned, clone, inside = [], torch.Tensor.clone, []

    def counting_clone(self, *args, **kwargs):
        if not inside:  # megarl's CPU device mode hands the call back to torch.Tensor.clone: count it once
            cloned.append(self.numel())
        inside.append(True)
        try:
            return clone(self, *args, **kwargs)
        finally:
            inside.pop()

    torch.Tensor.clone = counting_clone
    try:
        dcp_save.save({n: ShardedTensor.from_rank_offsets(n, v, replica_id=0) for n, v in views.items()}, directory)
    finally:
        torch.Tensor.clone = clone
    empty = {n: ShardedTensor.from_rank_offsets(n, torch.empty(4096), replica_id=0) for n in views}
    loaded = dist_checkpointing.load(empty, directory)
    return cloned, {name: torch.equal(loaded[name], expected[name]) for name in views}


def test_a_save_writes_contiguous_views_without_copying_them(tmp_path):
    # megatron-core's writer clones every view of a larger tensor (each half of a SwiGLU fc1; in a trainer
    # every parameter in DDP's buffer): only the strided view, which has no bytes of its own, is copied
    (cloned, equal) = run_distributed(_save_views, 1, str(tmp_path), timeout=120)[0]
    assert cloned == [4096]
    assert equal == {"top": True, "bottom": True, "strided": True}


def test_own_storage_is_the_same_memory_with_a_storage_of_its_own():
    from megarl.models.dcp_save import own_storage

    whole = torch.randn(4, 6).to(torch.bfloat16)
    half = whole[2:]
    mine = own_storage(half)
    assert mine.data_ptr() == half.data_ptr() and mine.dtype == torch.bfloat16 and mine.shape == (2, 6)
    assert mine.untyped_storage().nbytes() == 2 * 6 * 2
    assert torch.equal(mine, half)
    whole[3, 0] = 7.0  # the same memory, not a copy
    assert mine[1, 0].item() == 7.0
    transposed, columns = whole.t(), whole[:, :3]  # not contiguous: megatron-core must copy these itself
    assert own_storage(whole) is whole and own_storage(transposed) is transposed and own_storage(columns) is columns


def test_a_file_written_behind_leaves_the_page_cache_once_on_disk(tmp_path, monkeypatch):
    import os

    from megarl.utils.write_behind import WriteBehindFile

    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(("sync", os.fstat(fd).st_size)))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.fstat(fd).st_size)))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append(("drop", off, n, advice)))
    data = bytes(range(256)) * 1000  # 256,000 bytes in writes of 7,000
    with WriteBehindFile(tmp_path / "f", chunk=64 << 10) as f:
        for start in range(0, len(data), 7000):
            f.write(data[start : start + 7000])
        f.sync()
    assert (tmp_path / "f").read_bytes() == data
    drops = [c for c in calls if c[0] == "drop"]
    # every 64 KiB, what was written is synced first, then dropped; the drops tile the file from its start
    assert [c[0] for c in calls] == ["sync", "drop"] * len(drops) + ["fsync"] and len(drops) == 3
    assert all(c[3] == os.POSIX_FADV_DONTNEED for c in drops)
    assert [(off, off + n) for _, off, n, _ in drops] == [(0, 70000), (70000, 140000), (140000, 210000)]
    assert [size for kind, size, *_ in calls if kind == "sync"] == [70000, 140000, 210000]
    assert calls[-1] == ("fsync", len(data))


def _save_written_behind(directory: str) -> dict:
    import functools

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import filesystem

    from megarl.models import dcp_save
    from megarl.utils import write_behind

    write_behind.WRITE_BEHIND_BYTES = 4096  # drop behind every few tensors of `_state`
    write_item, crc_while_writing = filesystem._write_item, set()

    @functools.wraps(write_item)  # its signature tells megarl's writer which arguments it takes
    def watched_write_item(*args, **kwargs):
        crc_while_writing.add(torch.serialization.get_crc32_options())
        return write_item(*args, **kwargs)

    filesystem._write_item = watched_write_item
    dcp_save.save(_state(fill=True), directory)
    loaded = dist_checkpointing.load(_state(fill=False), directory)
    return {
        "loaded": {key: sorted(set(value.tolist())) for key, value in loaded.items()},
        "crc32 while writing": crc_while_writing,
        "crc32 after": torch.serialization.get_crc32_options(),
    }


def test_a_checkpoint_written_behind_without_zip_checksums_loads_back(tmp_path):
    (seen,) = run_distributed(_save_written_behind, 1, str(tmp_path), timeout=120)
    assert seen["loaded"] == {f"w{i}": [float(i)] for i in range(TENSORS)}
    assert seen["crc32 while writing"] == {False} and seen["crc32 after"] is True


def test_an_asynchronous_saves_snapshot_copies_only_what_shares_memory_with_live_tensors():
    """`snapshot` clones a CPU tensor of the save that overlaps the caller's live tensors (a parameter, another
    view into its flat buffer) and keeps what the save built for itself (a gathered optimizer state) as it is."""
    from megarl.models.dcp_save import snapshot

    flat = torch.arange(100.0)  # a DDP-style flat buffer the caller goes on changing
    originals = {
        "param": flat[10:30],
        "tail": flat[90:],  # not a live tensor itself, but in the live parameter's storage
        "gathered": torch.arange(50.0),  # built by the save, nobody else holds it
        "other": torch.arange(200.0)[100:],  # a view into some other storage
        "empty": torch.empty(0),
    }
    buckets = [("f0", "k0", ([("bytes", b"x")], list(originals.items())))]
    [(name, key, (bytes_data, items))] = snapshot(buckets, live=[originals["param"], torch.empty(0)])
    assert (name, key, bytes_data) == ("f0", "k0", [("bytes", b"x")])
    same_memory = {item: t.data_ptr() == originals[item].data_ptr() for item, t in items}
    assert same_memory == {"param": False, "tail": False, "gathered": True, "other": True, "empty": True}
    flat.zero_()  # the caller changes its buffer: the snapshot keeps the values of the save
    assert torch.equal(dict(items)["param"], torch.arange(10.0, 30.0)) and dict(items)["tail"][0] == 90.0
