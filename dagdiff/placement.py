"""Stages: which stage a layer call belongs to (`dd.stage`), resolved when it is traced."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

from .errors import PlacementError

__all__ = ["stage", "current_stage", "check_stage"]

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
    """Layer calls made inside ``with dd.stage(k):`` belong to stage k (unless the layer says)."""
    token = _STAGE.set(check_stage(index))
    try:
        yield index
    finally:
        _STAGE.reset(token)


def current_stage() -> int | None:
    """The stage set by the innermost `stage` block, or None."""
    return _STAGE.get()


def annotate_stages(low: "object", token: str) -> dict:
    """The task dict of a lowered graph (stage annotations are added by the placement layer)."""
    return low.dsk  # type: ignore[attr-defined]
