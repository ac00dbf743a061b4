"""The same-host shared-memory transport's pieces (`megarl.rollout.sharding.shm`); whole syncs over it
run in test_sync_embedded.py (host_shm on and off, bit for bit)."""

import pytest
import torch

from megarl.rollout.sharding.protocol import alloc_flat
from megarl.rollout.sharding.shm import KEEP_SYNCS, ShmPeers, host_id, same_host


def test_a_place_opens_the_receivers_row_itself_not_a_copy():
    receiver, sender = ShmPeers(), ShmPeers()
    gathered = alloc_flat(2 * 1000, torch.float32, "cpu", shared=True).view(2, 1000)
    row = sender.open(receiver.place(gathered[1]), 1000, torch.float32)
    row.copy_(torch.arange(1000, dtype=torch.float32))  # what a sender's pack does
    assert torch.equal(gathered[1], torch.arange(1000, dtype=torch.float32))
    assert not gathered[0].any()  # nothing outside the row was written
    again = sender.open(receiver.place(gathered[0]), 1000, torch.float32)
    assert again.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()  # the file is opened once


def test_a_sender_keeps_files_that_syncs_alternate_between_and_closes_retired_ones():
    receiver, sender = ShmPeers(), ShmPeers()
    first, second = (alloc_flat(64, torch.float32, "cpu", shared=True) for _ in range(2))
    for sync in range(KEEP_SYNCS + 2):  # two consumers' rings, used in turn: both stay open
        sender.open(receiver.place(first if sync % 2 else second), 64, torch.float32)
        sender.end_sync()
        assert len(sender._opened) == (1 if sync == 0 else 2)
    for _ in range(KEEP_SYNCS):  # `first` retired (the receiver's ring grew): closed after KEEP_SYNCS syncs
        sender.open(receiver.place(second), 64, torch.float32)
        sender.end_sync()
    assert len(sender._opened) == 1


def test_ranks_share_memory_only_on_one_host_with_room_in_dev_shm():
    assert host_id() == host_id() is not None
    assert host_id(min_free_bytes=1 << 60) is None  # a container's small /dev/shm: gloo messages instead
    assert same_host(["a/1", "a/1"]) and not same_host(["a/1", "b/1"])
    assert not same_host(["a/1", None]) and not same_host([])


def test_no_room_in_dev_shm_is_a_clear_error_at_allocation_not_a_sigbus_later(monkeypatch):
    """A shared buffer's pages are reserved when it is made: where /dev/shm cannot hold them (a container's
    64 MiB default, or other processes filling it at the same time) the error names the fix; a filesystem
    without fallocate keeps the old behaviour (pages at first touch)."""
    import errno
    import os

    buf = alloc_flat(1 << 20, torch.float32, "cpu", shared=True)  # reserved: 4 MiB of /dev/shm
    buf.fill_(1.0)
    assert buf.is_shared()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(MemoryError, match=r"no room in /dev/shm for a 4 MiB weight-sync buffer.*--shm-size"):
        alloc_flat(1 << 20, torch.float32, "cpu", shared=True)

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    assert alloc_flat(16, torch.float32, "cpu", shared=True).numel() == 16
