"""Reversible attribute replacement shared by the patch modules (not a patch itself).

Every patch records the original attribute it replaces, so `remove_cpu_patches()` can restore
exactly what was there (including attributes that did not exist before).
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class AttrPatcher:
    """Replaces attributes on modules/classes and restores them in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append(
            (
                owner,
                name,
                owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING),
            )
        )
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __bool__(self) -> bool:
        return bool(self._saved)
