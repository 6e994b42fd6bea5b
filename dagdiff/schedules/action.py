"""One unit of pipeline work on a worker (`Action`) and its text form ``"F3.1"``."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ScheduleError


__all__ = ["ACTION_KINDS", "Action", "parse_action", "order_key"]

ACTION_KINDS = ("F", "B", "I", "W")
"""F: forward; B: full backward; I: input-gradient backward; W: weight-gradient backward."""

_ACTION_RE = re.compile(r"^\s*([FBIW])(\d+)(?:\.(\d+))?\s*$")


def order_key(a: "Action") -> tuple[int, int, int]:
    return (a.chunk, a.microbatch, "FBIW".index(a.kind))


@dataclass(frozen=True)
class Action:
    """One unit of work on a worker: ``kind`` of ``microbatch`` on model ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"Action kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        for field_name in ("microbatch", "chunk"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"Action {field_name} must be an int >= 0, got {value!r}")

    def format(self, show_chunk: bool = False) -> str:
        """``"F3"``, or ``"F3.1"`` when ``show_chunk`` is set or the chunk is non-zero."""
        if show_chunk or self.chunk:
            return f"{self.kind}{self.microbatch}.{self.chunk}"
        return f"{self.kind}{self.microbatch}"

    def __str__(self) -> str:
        return self.format()


def parse_action(text: str) -> Action:
    """Parse ``"F3"`` or ``"B2.1"`` (kind, microbatch, optional ``.chunk``) into an Action."""
    match = _ACTION_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ScheduleError(
            f"cannot parse action {text!r}: expected KIND MICROBATCH[.CHUNK] with KIND in "
            f"{'/'.join(ACTION_KINDS)}, e.g. 'F3' or 'B2.1'"
        )
    kind, mb, chunk = match.groups()
    return Action(kind, int(mb), int(chunk) if chunk is not None else 0)
