"""`dd.stage`: which pipeline stage a layer call belongs to (trace time)."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

from ..errors import PlacementError


__all__ = ["check_stage", "stage", "current_stage"]


_STAGE: ContextVar[int | None] = ContextVar("dagdiff_stage", default=None)


def check_stage(value: object, where: str = "stage") -> int | None:
    """Validate a stage number (a non-negative int, or None for 'unplaced')."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"{where} must be a non-negative int or None, got {value!r}")
    return value


@contextlib.contextmanager
def stage(index: int) -> Iterator[int]:
    """Layer calls made inside ``with dd.stage(k):`` belong to stage k (unless the layer says);
    one made outside every block goes on its traced inputs' stage if they all come from one
    (`Trace.add_call`), else stays unstaged."""
    token = _STAGE.set(check_stage(index))
    try:
        yield index
    finally:
        _STAGE.reset(token)


def current_stage() -> int | None:
    """The stage set by the innermost `stage` block, or None."""
    return _STAGE.get()
