"""The same-host shared-memory transport's pieces (`megarl.rollout.sharding.shm`); whole syncs over it
run in test_sync_embedded.py (host_shm on and off, bit for bit)."""

import torch

from megarl.rollout.sharding.protocol import alloc_flat
from megarl.rollout.sharding.shm import ShmPeers, host_id, same_host


def test_a_place_opens_the_receivers_row_itself_not_a_copy():
    receiver, sender = ShmPeers(), ShmPeers()
    gathered = alloc_flat(2 * 1000, torch.float32, "cpu", shared=True).view(2, 1000)
    row = sender.open(receiver.place(gathered[1]), 1000, torch.float32)
    row.copy_(torch.arange(1000, dtype=torch.float32))  # what a sender's pack does
    assert torch.equal(gathered[1], torch.arange(1000, dtype=torch.float32))
    assert not gathered[0].any()  # nothing outside the row was written
    again = sender.open(receiver.place(gathered[0]), 1000, torch.float32)
    assert again.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()  # the file is opened once


def test_a_sender_closes_the_files_a_sync_did_not_use():
    receiver, sender = ShmPeers(), ShmPeers()
    old, new = (alloc_flat(64, torch.float32, "cpu", shared=True) for _ in range(2))
    sender.open(receiver.place(old), 64, torch.float32)
    sender.end_sync()
    sender.open(receiver.place(new), 64, torch.float32)  # the receiver's ring grew: a new file
    sender.end_sync()
    assert len(sender._opened) == 1


def test_ranks_share_memory_only_on_one_host_with_room_in_dev_shm():
    assert host_id() == host_id() is not None
    assert host_id(min_free_bytes=1 << 60) is None  # a container's small /dev/shm: gloo messages instead
    assert same_host(["a/1", "a/1"]) and not same_host(["a/1", "b/1"])
    assert not same_host(["a/1", None]) and not same_host([])
