"""Pipeline-parallel schedules as plain data: per worker, the ordered actions it runs
(no Dask, no JAX), and the one simulator that checks and times them."""
from __future__ import annotations

from ..errors import ScheduleError
from .action import ACTION_KINDS, Action, parse_action
from .base import Schedule
from .builtin import SCHEDULES, GPipe, Interleaved, OneFOneB, ZeroBubbleH1, get_schedule
from .simulate import SimResult, bubble_formula, ideal_makespan, simulate

__all__ = [
    "ACTION_KINDS",
    "Action",
    "GPipe",
    "Interleaved",
    "OneFOneB",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "ZeroBubbleH1",
    "bubble_formula",
    "get_schedule",
    "ideal_makespan",
    "parse_action",
    "simulate",
]
