"""`Schedule`: the base of every pipeline schedule - per worker, an ordered list of actions."""
from __future__ import annotations

import collections
from abc import ABC, abstractmethod

from ..errors import ScheduleError
from .action import Action, order_key, parse_action


__all__ = ["Schedule", "schedule_error", "is_pos_int", "interleaved_layout", "v_layout"]


def schedule_error(name: str, num_stages: object, microbatches: object,
                   problem: str, fix: str) -> ScheduleError:
    return ScheduleError(
        f"{name!r} schedule with num_stages={num_stages!r}, microbatches={microbatches!r}: "
        f"{problem}; fix: {fix}"
    )


def is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def interleaved_layout(num_workers: int, virtual_stages: int) -> list[list[int]]:
    """Chunk c of worker w is global stage c * p + w (Megatron / torch "loop" style)."""
    p = num_workers
    return [[c * p + w for c in range(virtual_stages)] for w in range(p)]


def v_layout(num_workers: int) -> list[list[int]]:
    """Worker w holds stages w (chunk 0) and 2p - 1 - w (chunk 1): down the workers and back
    up in a V, so the last worker holds the middle two stages and worker 0 holds the first
    and the last (ZB-V, DualPipeV; torch's ``style="v"``)."""
    p = num_workers
    return [[w, 2 * p - 1 - w] for w in range(p)]


class Schedule(ABC):
    """A pipeline schedule: per worker, the ordered list of actions it executes.

    Subclasses set ``name`` (and ``split_backward`` / ``virtual_stages`` when they
    differ from the defaults) and implement :meth:`orders`. A schedule whose chunks are
    not placed interleaved (chunk c of worker w = stage c * p + w) overrides
    :meth:`stage_layout`.
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

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        """Per worker, the global stage of each of its chunks, in chunk order.

        The default is the interleaved layout: chunk c of worker w is global stage
        c * p + w (``[[0], [1], ...]`` with one chunk per worker). Override it to place
        chunks otherwise (the V schedules return :func:`v_layout`); every global stage
        0..p * v - 1 must appear exactly once, ``virtual_stages`` of them per worker.
        """
        return interleaved_layout(num_workers, self.virtual_stages)

    def checked_layout(self, num_workers: int) -> list[list[int]]:
        """`stage_layout()` checked: p lists of ``virtual_stages`` ints that together hold
        every global stage 0..p * v - 1 exactly once."""
        p, v = num_workers, self.virtual_stages
        fix = (f"return from stage_layout({p}) one list per worker of its {v} global "
               f"stage(s) in chunk order, together every stage 0..{p * v - 1} once, e.g. "
               f"{interleaved_layout(p, v)}")

        def bad(problem: str) -> ScheduleError:
            return ScheduleError(
                f"{self.name!r} schedule with num_stages={p!r} workers and virtual_stages="
                f"{v!r}: stage_layout() {problem}; fix: {fix}")

        try:
            layout = [list(stages) for stages in self.stage_layout(p)]
        except TypeError as e:
            raise bad(f"did not return lists ({e})") from e
        if len(layout) != p:
            raise bad(f"returned {len(layout)} worker lists for {p} workers")
        for w, stages in enumerate(layout):
            if len(stages) != v:
                raise bad(f"gives worker {w} {len(stages)} chunk(s) {stages}, not {v}")
            if not all(isinstance(g, int) and not isinstance(g, bool) for g in stages):
                raise bad(f"gives worker {w} non-int stages {stages!r}")
        flat = collections.Counter(g for stages in layout for g in stages)
        repeated = sorted(g for g, n in flat.items() if n > 1)
        outside = sorted(g for g in flat if not 0 <= g < p * v)
        missing = sorted(set(range(p * v)) - set(flat))
        problems = [f"{label} {values}" for label, values in (
            ("repeats stage(s)", repeated), ("has stage(s) out of range", outside),
            ("lacks stage(s)", missing)) if values]
        if problems:
            raise bad("; ".join(problems))
        return layout

    @abstractmethod
    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """Per worker (0-based stage index), the actions in execution order."""

    def table(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """`orders()` checked: one list per worker, each running every one of its actions
        exactly once (F and B, or F, I and W with ``split_backward``, for each microbatch
        and virtual stage); action strings such as ``"F0"`` are parsed."""
        self.validate(num_stages, microbatches)
        self.checked_layout(num_stages)
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
            for worker in self.table(num_stages, microbatches)
        ]

    def peak_live(self, num_stages: int, microbatches: int) -> list[int]:
        """Per worker, the most microbatches whose forward state is alive at once.

        F allocates; B frees (W for split-backward schedules: state lives from F until W;
        I frees nothing). With virtual stages each (microbatch, chunk) pair counts once (a
        chunk holds 1 / v of the worker's layers, so v pairs make one 1F1B microbatch).
        """
        peaks = []
        for worker in self.table(num_stages, microbatches):
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
