"""Direct-dispatch actions drawn live in the Dask dashboard's Task Stream, one bar each.

A direct-dispatch program is one Dask task that runs a worker's actions itself, so the
task stream alone shows one ``prog_slot<i>`` bar per worker and step. While a program
runs, its worker batches the actions it finished (key, start, stop) and reports them to
the scheduler every `INTERVAL` s and at the program's end, with distributed's public
``Worker.log_event`` (the worker's batched stream, no new connection). On the scheduler,
`LiveActions` hands each action to the task-stream plugin as a finished task: a bar per
action with its key's name (``fwd_<layer>``, ``vjp_<layer>``, ...) and colour, on a row
of its own per worker (``thread`` `ROW`) next to the programs' rows, marked
``dagdiff=MARKER`` so that readers of the task stream (`dd.record`) can tell them from
Dask tasks. Nothing is kept when no task stream is watched (no dashboard page, no
``get_task_stream``). Dask config ``dagdiff.dashboard.live-actions`` (default True),
read when a step is built, turns it off.
"""
from __future__ import annotations

import logging
from typing import Any

import dask
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time as now

from .internals import forget_topic_events, scheduler_delay, task_stream_record


__all__ = ["TOPIC", "MARKER", "ROW", "INTERVAL", "enabled", "ActionReporter", "LiveActions",
           "is_live_action"]

log = logging.getLogger(__name__)

#: the event topic of the workers' reports
TOPIC = "dagdiff-actions"
#: value of the ``dagdiff`` field of a task-stream record made from a reported action
MARKER = "action"
#: the ``thread`` of those records: the dashboard draws a row per (worker, thread), so the
#: actions get a row of their own instead of lying under their program's bar
ROW = "dagdiff-actions"
#: seconds between a program's reports (a 20 ms action is on the dashboard ~0.1 s later)
INTERVAL = 0.1


def enabled() -> bool:
    """Whether steps built now report their actions (``dagdiff.dashboard.live-actions``)."""
    return bool(dask.config.get("dagdiff.dashboard.live-actions", True))


class ActionReporter:
    """One program run's finished actions, reported to the scheduler in batches."""

    def __init__(self, worker: Any, program: str, interval: float = INTERVAL) -> None:
        self.worker = worker
        self.program = program
        self.interval = interval
        self.pending: list[tuple[str, float, float]] = []
        self.last = now()

    def add(self, key: str, start: float, stop: float) -> None:
        """An action ran from `start` to `stop` (worker clock); report the batch when
        `interval` has passed since the last report."""
        self.pending.append((key, start, stop))
        if stop - self.last >= self.interval:
            self.last = stop
            self.flush()

    def flush(self) -> None:
        """Report what is pending, in the scheduler's clock (best effort: a worker that
        is closing drops it)."""
        if not self.pending:
            return
        delay = scheduler_delay(self.worker)
        batch = [[k, a + delay, b + delay] for k, a, b in self.pending]
        self.pending = []
        try:
            self.worker.log_event(TOPIC, {"program": self.program, "actions": batch})
        except Exception as e:              # noqa: BLE001 - never fail a program for it
            log.debug("dagdiff: could not report %d actions of %s (%s)", len(batch),
                      self.program, e)


class LiveActions(SchedulerPlugin):
    """On the scheduler: each reported action becomes a task-stream record (a bar in the
    dashboard's Task Stream), when a task stream is kept."""

    name = "dagdiff-live-actions"
    idempotent = True                  # registered once per cluster, by its first client

    def __init__(self) -> None:
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != TOPIC or self.scheduler is None or not isinstance(msg, dict):
            return
        # the report is used up here: the scheduler need not keep it (`forget_topic_events`)
        forget_topic_events(self.scheduler, TOPIC)
        worker, program = msg.get("worker"), msg.get("program")
        for key, start, stop in msg.get("actions", ()):
            if not task_stream_record(self.scheduler, key, start, stop, worker, thread=ROW,
                                      program=program, dagdiff=MARKER):
                return                      # nobody watches: nothing to draw


def is_live_action(record: Any) -> bool:
    """Whether a task-stream record is a reported action (not a Dask task of its own)."""
    return isinstance(record, dict) and record.get("dagdiff") == MARKER
