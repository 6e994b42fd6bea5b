"""A build's options (what `dd.value_and_grad` and `dd.Trainer` take as keywords), validated
once, and the part of them every task key carries (`Options.token`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import dask

from ..core.auto import CostSource, is_cost_source
from ..core.remat import RematPolicy, check_remat
from ..core.stage import check_stage
from ..errors import ArgumentError
from ..schedules import Schedule, get_schedule


__all__ = ["Options", "DISPATCH_MODES", "LOWERING_SETTINGS"]

DISPATCH_MODES = ("direct", "scheduler")

#: Dask config that changes what a step's tasks do (read while lowering): part of
#: `Options.token`, so of every key
LOWERING_SETTINGS = ("dagdiff.fuse-loss-backward", "dagdiff.dashboard.live-actions",
                     "dagdiff.direct.timeout")


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Options:
    """The options of a build, validated once (`Options.make`): what `dd.value_and_grad`
    and `dd.Trainer` take as keywords. `schedule` is resolved (None: no pipeline);
    `fuse` is resolved (None means: fuse pipelines, nothing else)."""

    argnums: int | tuple[int, ...] = 0
    has_aux: bool = False
    microbatches: int = 1
    schedule: Schedule | None = None
    batch_argnums: tuple[int, ...] | None = None
    batch_axis: int = 0
    stages: int | str | CostSource | None = None
    placement: tuple[tuple[int, Any], ...] = ()
    fuse: bool = False
    resident: bool = True
    dispatch: str | None = None
    remat: RematPolicy = "none"
    #: who took these options (``"dd.Trainer"``, ``"dd.value_and_grad"``): errors name it
    where: str = dataclasses.field(default="dd.value_and_grad", compare=False)

    @classmethod
    def make(cls, where: str, *, argnums: int | Sequence[int] = 0, has_aux: bool = False,
             microbatches: int = 1, schedule: Any = None,
             batch_argnums: Sequence[int] | None = None, batch_axis: int = 0,
             stages: int | str | CostSource | None = None,
             placement: Mapping[int, Any] | None = None,
             fuse: bool | None = None, resident: bool = True,
             dispatch: str | None = None, remat: Any = None) -> "Options":
        """Validate the keywords of `where` (e.g. ``"dd.value_and_grad"``)."""
        if not _pos_int(microbatches):
            raise ArgumentError(f"{where}: microbatches must be a positive int, got "
                                f"{microbatches!r}")
        if dispatch not in (None, *DISPATCH_MODES):
            raise ArgumentError(f"{where}: dispatch must be 'direct', 'scheduler' or None, got "
                                f"{dispatch!r}")
        if not (stages is None or (isinstance(stages, str) and stages == "auto")
                or _pos_int(stages) or is_cost_source(stages)):
            raise ArgumentError(f"{where}: stages must be 'auto', a positive int, a dd.Profile "
                                f"(balance by its measured times) or None, got {stages!r}")
        if not isinstance(batch_axis, int) or isinstance(batch_axis, bool):
            raise ArgumentError(f"{where}: batch_axis must be an int, got {batch_axis!r}")
        if placement is not None and not isinstance(placement, Mapping):
            raise ArgumentError(f"{where}: placement must be a dict {{stage: slot}}, got "
                                f"{type(placement).__name__}")
        for s in placement or {}:
            check_stage(s, "a key of placement")
        pipelined = microbatches > 1 or schedule is not None
        sched = get_schedule(schedule if schedule is not None else "1f1b") if pipelined else None
        nums = argnums if isinstance(argnums, int) else tuple(argnums)
        bnums = None if batch_argnums is None else (
            (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums))
        return cls(nums, bool(has_aux), microbatches, sched, bnums, batch_axis, stages,
                   tuple(sorted((placement or {}).items())),
                   pipelined if fuse is None else bool(fuse), bool(resident), dispatch,
                   check_remat(where, remat), where)

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    def token(self) -> tuple[Any, ...]:
        """What of the options is part of a step's task keys, with the Dask config that
        lowering reads (`LOWERING_SETTINGS`, at build time): two builds that differ only
        in one of them get different keys."""
        return (self.argnums, self.has_aux, self.fuse, self.microbatches,
                repr(self.schedule), self.batch_axis, self.remat,
                tuple(str(dask.config.get(k, None)) for k in LOWERING_SETTINGS))
