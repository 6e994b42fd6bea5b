"""A schedule compiled for p workers and m microbatches (`PipelineProgram`): per worker, the
actions it runs in order, each with its global stage, checked once (every action once, a
valid layout, runnable). It is the one form of the order the lowering reads (each action
becomes its tasks: ordering edges for scheduler dispatch, a program's order for direct
dispatch), and what a user prints to see who runs what when."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Hashable

from .base import Schedule
from .builtin import get_schedule
from .simulate import simulate


__all__ = ["StageAction", "PipelineProgram", "compile_schedule"]


@dataclass(frozen=True)
class StageAction:
    """One action of a worker's program: `kind` (F, B, I, W) of `microbatch` on the
    global stage `stage` (the worker's model chunk `chunk`)."""

    kind: str
    microbatch: int
    stage: int
    chunk: int = 0

    def format(self) -> str:
        """``"F3"``: the kind and the microbatch."""
        return f"{self.kind}{self.microbatch}"

    def key(self) -> tuple[int, int, str]:
        """(stage, microbatch, kind): what names this action's tasks in a lowered step."""
        return (self.stage, self.microbatch, self.kind)


@dataclass(frozen=True)
class PipelineProgram:
    """`schedule` compiled for `num_workers` workers and `microbatches` microbatches:
    ``workers[w]`` is worker w's actions in the order it runs them."""

    schedule: Schedule
    num_workers: int
    microbatches: int
    virtual_stages: int
    workers: tuple[tuple[StageAction, ...], ...]

    @property
    def num_stages(self) -> int:
        """Global stages: workers x stages per worker."""
        return self.num_workers * self.virtual_stages

    def _cell(self, a: StageAction) -> str:
        return a.format() + (f"@s{a.stage}" if self.virtual_stages > 1 else "")

    def steps(self) -> list[list[StageAction | None]]:
        """The program on a time grid (as torch's pipeline order tables): row t holds what
        each worker runs in time step t when every action takes one step and waits only
        for the actions it depends on; None where a worker idles."""
        v = self.virtual_stages
        sim = simulate(self.schedule, self.num_workers, self.microbatches,
                       f=1.0, b=1.0, i=1.0, w=1.0)
        rows: list[list[StageAction | None]] = []
        for w, spans in enumerate(sim.spans):
            for a, (_, start, _) in zip(self.workers[w], spans):
                t = round(start * v)
                while len(rows) <= t:
                    rows.append([None] * self.num_workers)
                rows[t][w] = a
        return rows

    def format(self) -> str:
        """A table with one column per worker and one row per time step (`steps`):
        ``F3`` is the forward of microbatch 3 (``@s5``: on global stage 5), blank cells
        are bubbles."""
        rows = self.steps()
        cells = [[self._cell(a) if a is not None else "" for a in r] for r in rows]
        width = max([len(f"worker {self.num_workers - 1}")] +
                    [len(c) for r in cells for c in r])
        head = " " * 10 + "  ".join(f"{f'worker {w}':<{width}}"
                                   for w in range(self.num_workers))
        lines = [f"{self.schedule.name}: {self.num_workers} workers, {self.microbatches} "
                 f"microbatches" + (f", {self.virtual_stages} stages per worker"
                                    if self.virtual_stages > 1 else ""), head.rstrip()]
        for t, r in enumerate(cells):
            lines.append((f"step {t:>3}: " + "  ".join(f"{c:<{width}}" for c in r)).rstrip())
        return "\n".join(lines)

    def to_csv(self) -> str:
        """One line per worker: its actions in order, comma-separated, each as torch
        writes an action (``<stage><kind><microbatch>``: ``1B3`` is the backward of
        microbatch 3 on global stage 1): the compute-only CSV that torch's pipeline
        schedules dump and load (``_dump_csv`` / ``_load_csv``)."""
        return "\n".join(",".join(f"{a.stage}{a.kind}{a.microbatch}" for a in acts)
                         for acts in self.workers)

    def __str__(self) -> str:
        return self.format()


def compile_schedule(schedule: str | Schedule, num_workers: int,
                     microbatches: int) -> PipelineProgram:
    """`schedule` (a name or a `Schedule`) for `num_workers` workers and `microbatches`
    microbatches: checked (`Schedule.table`: each action once; `simulate`: it can run)
    and with each action's global stage from the schedule's layout. Compiled once per
    (schedule, workers, microbatches): schedules of one class with the same attributes
    share it (`_CACHE_SIZE` programs kept, least recently used out)."""
    sched = get_schedule(schedule) if isinstance(schedule, str) else schedule
    key = _key(sched, num_workers, microbatches)
    if key is not None:
        with _LOCK:
            got = _CACHE.get(key)
            if got is not None:
                _CACHE.move_to_end(key)
                return got
    program = _compile(sched, num_workers, microbatches)
    if key is not None:
        with _LOCK:
            _CACHE[key] = program
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return program


_CACHE_SIZE = 256
_CACHE: "collections.OrderedDict[Hashable, PipelineProgram]" = collections.OrderedDict()
_LOCK = threading.Lock()


def _key(sched: Schedule, p: int, m: int) -> Hashable | None:
    """A schedule's class and attributes with (p, m); None when they cannot be hashed
    (such a schedule is compiled every time)."""
    try:
        key = (type(sched), tuple(sorted(vars(sched).items())), p, m)
        hash(key)
    except TypeError:
        return None
    return key


def _compile(sched: Schedule, p: int, m: int) -> PipelineProgram:
    table = sched.table(p, m)
    layout = sched.checked_layout(p)
    simulate(sched, p, m)                    # a custom schedule that cannot run fails here
    workers = tuple(tuple(StageAction(a.kind, a.microbatch, layout[w][a.chunk], a.chunk)
                          for a in acts) for w, acts in enumerate(table))
    return PipelineProgram(sched, p, m, sched.virtual_stages, workers)
