"""How the driver calls a role's method: declared once, on the method, by `@remote(...)`.

A role class (`megarl.workers`) marks each method the driver may call with the way its arguments
reach the ranks and its results come back:

    ROWS     the batch argument's rows are split over the role's data-parallel ranks (balanced
             by tokens; every TP/PP/CP peer of a DP rank gets the same rows) and the per-row
             results (a Batch) are merged back in the input's row order
    METRICS  rows split as ROWS; the result is one rank's (metrics that are already reduced
             over the role's ranks, e.g. an optimizer step's loss and grad norm)
    ALL      every rank gets the same arguments; the result is rank 0's (checkpoints, exports)

The driver's handle on a role (`megarl.controller.worker_group.RoleHandle`) reads the mark, so
`cluster.actor.compute_log_probs(batch)` runs the method of `megarl.workers.Actor` the way its
decorator says: the call an editor follows is the method that runs. Standard library only.
"""

from __future__ import annotations

from typing import Callable, Optional

ROWS, METRICS, ALL = "rows", "metrics", "all"
DISPATCH_MODES = (ROWS, METRICS, ALL)
_ATTR = "__megarl_dispatch__"


def remote(dispatch: str) -> Callable[[Callable], Callable]:
    """Mark a role method as callable from the driver, with `dispatch` one of ROWS, METRICS, ALL."""
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch {dispatch!r} is unknown; pick one of {', '.join(DISPATCH_MODES)}")

    def mark(method: Callable) -> Callable:
        setattr(method, _ATTR, dispatch)
        return method

    return mark


def dispatch_mode(cls: type, method: str) -> Optional[str]:
    """The `@remote` dispatch mode of `cls.method`, or None when the method is not remote."""
    return getattr(getattr(cls, method, None), _ATTR, None)


def remote_methods(cls: type) -> dict[str, str]:
    """{method name: dispatch mode} of every `@remote` method of `cls`."""
    return {name: mode for name in dir(cls) if (mode := dispatch_mode(cls, name)) is not None}
