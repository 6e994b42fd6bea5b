"""`Schedule`: the base of every pipeline schedule - per worker, an ordered list of actions."""
from __future__ import annotations

import collections
from abc import ABC, abstractmethod

from ..errors import ScheduleError
from .action import Action, order_key, parse_action

__all__ = ["Schedule", "schedule_error", "is_pos_int"]


def schedule_error(name: str, num_stages: object, microbatches: object,
                    problem: str, fix: str) -> ScheduleError:
    return ScheduleError(
        f"{name!r} schedule with num_stages={num_stages!r}, microbatches={microbatches!r}: "
        f"{problem}; fix: {fix}"
    )



def is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0



class Schedule(ABC):
    """A pipeline schedule: per worker, the ordered list of actions it executes.

    Subclasses set ``name`` (and ``split_backward`` / ``virtual_stages`` when they
    differ from the defaults) and implement :meth:`orders`.
    """

    name: str = "custom"
    split_backward: bool = False
    virtual_stages: int = 1

    def validate(self, num_stages: int, microbatches: int) -> None:
        """Raise ScheduleError unless both arguments are positive ints."""
        for label, value in (("num_stages", num_stages), ("microbatches", microbatches)):
            if not is_pos_int(value):
                raise schedule_error(
                    self.name, num_stages, microbatches,
                    f"{label} must be a positive int, got {value!r}",
                    f"pass {label} as an int >= 1",
                )

    @abstractmethod
    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """Per worker (0-based stage index), the actions in execution order."""

    def _checked_orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """`orders()` checked: one list per worker, each running every one of its actions
        exactly once (F and B, or F, I and W with ``split_backward``, for each microbatch
        and virtual stage); action strings such as ``"F0"`` are parsed."""
        self.validate(num_stages, microbatches)
        try:
            result = [[a if isinstance(a, Action) else parse_action(a) for a in worker]
                      for worker in self.orders(num_stages, microbatches)]
        except (TypeError, ValueError) as e:
            raise schedule_error(
                self.name, num_stages, microbatches, f"orders() did not return lists of "
                f"actions ({type(e).__name__}: {e})",
                "return one list of dd.Action (or strings like 'F0', 'B2.1') per worker",
            ) from e
        if len(result) != num_stages:
            raise schedule_error(
                self.name, num_stages, microbatches,
                f"orders() returned {len(result)} worker lists",
                "return exactly one list of actions per stage from orders()",
            )
        kinds = ("F", "I", "W") if self.split_backward else ("F", "B")
        want = collections.Counter(Action(k, mb, c) for k in kinds
                                   for mb in range(microbatches)
                                   for c in range(self.virtual_stages))
        for w, worker in enumerate(result):
            got = collections.Counter(worker)
            if got != want:
                show = self.virtual_stages > 1
                missing = sorted((want - got).elements(), key=order_key)
                extra = sorted((got - want).elements(), key=order_key)
                problem = "; ".join(
                    f"{label} {', '.join(a.format(show) for a in acts[:6])}"
                    f"{' ...' if len(acts) > 6 else ''}"
                    for label, acts in (("is missing", missing), ("has extra", extra)) if acts)
                raise schedule_error(
                    self.name, num_stages, microbatches, f"worker {w} {problem}",
                    f"each worker runs {'/'.join(kinds)} exactly once per microbatch "
                    f"(0..{microbatches - 1})"
                    + (f" and virtual stage (0..{self.virtual_stages - 1})"
                       if self.virtual_stages > 1 else "")
                    + ("; I and W need split_backward = True on the schedule"
                       if any(a.kind in "IW" for a in extra) and not self.split_backward
                       else ""),
                )
        return result

    def actions(self, num_stages: int, microbatches: int) -> list[list[str]]:
        """Per worker, action strings such as ``"F0"`` (``"F0.1"`` with virtual stages)."""
        show_chunk = self.virtual_stages > 1
        return [
            [a.format(show_chunk) for a in worker]
            for worker in self._checked_orders(num_stages, microbatches)
        ]

    def peak_live(self, num_stages: int, microbatches: int) -> list[int]:
        """Per worker, the most microbatches whose forward state is alive at once.

        F allocates; B frees (W for split-backward schedules: state lives from F until W;
        I frees nothing). With virtual stages each (microbatch, chunk) pair counts once.
        """
        peaks = []
        for worker in self._checked_orders(num_stages, microbatches):
            live = peak = 0
            for a in worker:
                if a.kind == "F":
                    live += 1
                    peak = max(peak, live)
                elif a.kind in ("B", "W"):
                    live -= 1
            peaks.append(peak)
        return peaks

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

