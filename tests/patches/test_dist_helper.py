"""megarl.testing.dist.run_distributed: results by rank, env and gloo set up, a rank's exception
re-raised with its rank and traceback, stragglers killed at the timeout. Ranks here skip the
megatron patches (apply_patches=False) so each run costs only a torch import."""

from __future__ import annotations

import os
import time

import pytest
import torch

from megarl.testing.dist import DistributedTestError, run_distributed


def report_env_and_all_reduce(scale: int) -> dict:
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return {
        "env": {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "sum": scale * value.item(),
        "tensor": torch.full((3,), float(dist.get_rank())),
    }


def rank1_raises_while_rank0_waits() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # never completes: rank 1 is gone


def rank1_builds_its_own_group_after_rank0_returned() -> int:
    """Rank 0 returns at once; rank 1 then makes a group only it belongs to, through rank 0's store."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        return 0
    time.sleep(1.5)  # rank 0 has long returned
    group = dist.new_group(ranks=[1])
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return int(value.item())


def sleep_forever() -> None:
    time.sleep(600)


def test_run_distributed_returns_each_ranks_value_in_rank_order():
    results = run_distributed(report_env_and_all_reduce, 2, 10, apply_patches=False, timeout=60)
    assert [r["env"]["RANK"] for r in results] == ["0", "1"]
    assert all(r["env"]["MASTER_ADDR"] == "127.0.0.1" and r["env"]["WORLD_SIZE"] == "2" for r in results)
    assert [r["env"]["LOCAL_RANK"] for r in results] == ["0", "1"]
    assert all(r["backend"] == "gloo" and r["threads"] == 1 and r["sum"] == 30.0 for r in results)
    assert [r["tensor"].tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def test_rank0_keeps_the_store_until_every_rank_is_done():
    """Rank 0 hosts the rendezvous store; a rank that builds a group after rank 0's function returned
    (a role placed on rank 1 only) must still reach it (CI once failed with "Connection reset by peer")."""
    assert run_distributed(rank1_builds_its_own_group_after_rank0_returned, 2, apply_patches=False, timeout=60) == [
        0,
        1,
    ]


def test_exception_on_one_rank_is_reraised_with_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(rank1_raises_while_rank0_waits, 2, apply_patches=False, timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "boom on purpose" in str(info.value)
    assert "rank1_raises_while_rank0_waits" in info.value.remote_traceback
    assert time.monotonic() - start < 30  # rank 0, stuck in the barrier, was killed after the grace


def test_stragglers_are_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_distributed(sleep_forever, 1, apply_patches=False, timeout=2)
    assert time.monotonic() - start < 20


def parent_pid() -> int:
    return os.getppid()


def test_ranks_are_spawned_where_cuda_is_available(monkeypatch):
    """A process forked from one that asked CUDA anything (even `torch.cuda.is_available()`, which
    megatron-core's imports call) cannot use CUDA: with CUDA the ranks are spawned by this process,
    on CPU they are forked from the forkserver that preloaded torch and megatron-core."""
    assert run_distributed(parent_pid, 1, apply_patches=False) != [os.getpid()]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run_distributed(parent_pid, 1, apply_patches=False) == [os.getpid()]
