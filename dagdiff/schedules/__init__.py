"""Pipeline-parallel schedules as plain data: per worker, the ordered actions it runs
(no Dask, no JAX), and the one simulator that checks and times them."""
from __future__ import annotations

from ..errors import ScheduleError
from .action import ACTION_KINDS, Action, parse_action
from .base import Schedule, interleaved_layout, v_layout
from .builtin import SCHEDULES, GPipe, Interleaved, OneFOneB, ZeroBubbleH1, get_schedule
from .multichunk import DualPipeV, InterleavedZeroBubble, LoopedBFS, ZeroBubbleV
from .program import PipelineProgram, StageAction, compile_schedule
from .simulate import SimResult, bubble_formula, ideal_makespan, simulate


__all__ = [
    "ACTION_KINDS",
    "Action",
    "DualPipeV",
    "GPipe",
    "Interleaved",
    "InterleavedZeroBubble",
    "LoopedBFS",
    "OneFOneB",
    "PipelineProgram",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageAction",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "bubble_formula",
    "compile_schedule",
    "get_schedule",
    "ideal_makespan",
    "interleaved_layout",
    "parse_action",
    "simulate",
    "v_layout",
]
