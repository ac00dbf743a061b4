"""`run_distributed` with test defaults (2-minute timeout, one thread per rank: CI has 2 cores).

The implementation lives in `megarl.utils.distributed`; this module only sets defaults for tests.
"""

from __future__ import annotations

from typing import Any, Callable, List

from megarl.utils.distributed import RankError, free_port
from megarl.utils.distributed import run_distributed as _run_distributed

DistributedTestError = RankError
__all__ = ["DistributedTestError", "RankError", "free_port", "run_distributed"]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, num_threads: int = 1, **kwargs: Any
) -> List[Any]:
    """Run `fn` on `world_size` gloo ranks with the test defaults; see `megarl.utils.distributed`."""
    return _run_distributed(fn, world_size, *args, timeout=timeout, num_threads=num_threads, **kwargs)
