"""Several Trainer steps submitted as one Dask computation (`Trainer.fit(window=k)`).

Each step is built as `Trainer.step` builds it (traced, bound to its template, chained to
the step before: its programs read the state the program before made on their worker in
place), from the state the step before will make; then the k steps' graphs become one
(`dagdiff.build.window_graph`): per worker one task running its k programs in order, one
nonce, the k losses as one output and the last step's state. A step costs Dask a task
per worker for k steps instead of about six tasks, which is most of a small step's time.
The steps inside a window make no state a client can hold (only the last one does): a
failure anywhere in the window runs the window's steps again from the state before it
(`fit`'s recovery, one step at a time). Steps that cannot share a window (`can_share`:
scheduler dispatch, or steps not chained on the workers) are submitted one by one. With
replicas, each step's loss (the replicas' mean) reads the loss workers' parts through one
small task on each.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import dask

from ..build import WindowError, freeze_heap, submit, window_graph
from ..runtime.taskspec import TaskRef
from .recovery import StepLoss, WindowLoss
from .state import TrainState

if TYPE_CHECKING:
    from .step_graph import Prepared
    from .trainer import Trainer


__all__ = ["submit_window", "can_share"]

log = logging.getLogger(__name__)


def submit_window(trainer: "Trainer", state: TrainState, batches: Sequence[Sequence[Any]]
                  ) -> list[tuple[TrainState, Any]]:
    """Submit the steps of `batches` from `state` as one computation where they can share
    one; per step, (the state it makes, its loss). Only the last state is one a client
    can hold and step from; the others stand for it in `fit`'s bookkeeping."""
    tr = trainer
    if len(batches) < 2 or not can_share(tr):
        out, now = [], state
        for b in batches:
            now, loss = tr.step(now, *b)
            out.append((now, loss))
        return out
    pres: list[Prepared] = []
    now = state
    for b in batches:
        pre = tr._prepare(now, b)
        pres.append(pre)
        now = _inside(tr, pre)
    lineages = _lineages(tr, pres[0].state, batches)
    try:
        if not all(p.direct for p in pres):
            raise WindowError("a step of the window does not dispatch directly")
        graph, renamed = window_graph([p.graph for p in pres],
                                      [str(p.out_keys[0]) for p in pres],
                                      [[str(k) for k in p.out_keys[1:]] for p in pres])
    except WindowError as e:
        log.debug("dagdiff: %d steps submitted one by one: %s", len(pres), e)
        return _each(tr, pres, lineages)
    freeze_heap(tr.client)
    last = pres[-1]
    for old, key in renamed.items():          # the next step reads the state in place
        if old in tr._sources:
            tr._sources[key] = tr._sources[old]
    values = submit(tr.client, graph, [renamed.get(str(k), str(k)) for k in last.out_keys])
    out: list[tuple[TrainState, Any]] = []
    got: list[Any] = []                       # the window's losses, once one step has them
    for i, pre in enumerate(pres):
        loss = WindowLoss(values[0].key, tr.client, pre.state.step, last.workers, i, got)
        if pre is last:
            out.append((tr._finish(pre, loss, values[1:], lineages[-1]), loss))
        else:
            out.append((_inside(tr, pre, loss), loss))
    return out


def can_share(trainer: "Trainer") -> bool:
    """Whether `trainer`'s steps can share a window (else each is submitted alone): a
    cluster, steps chained on the workers, and not dispatch="scheduler"."""
    return (trainer.client is not None and trainer.options.dispatch != "scheduler"
            and bool(dask.config.get("dagdiff.direct.chain-steps", True)))


def _inside(tr: "Trainer", pre: "Prepared", loss: Any = None) -> TrainState:
    """The state a step inside a window makes: its values named by the keys the window
    does not compute (the next step of the window reads them in place)."""
    return TrainState(pre.state.step + 1, groups=pre.model.groups, owner=tr._ref,
                      placed={rg: TaskRef(str(k)) for rg, k in zip(pre.order,
                                                                   pre.out_keys[1:])},
                      where=dict(pre.where), loss=loss, in_window=True,
                      signature=pre.state.signature)


def _lineages(tr: "Trainer", start: TrainState, batches: Sequence[Sequence[Any]]
              ) -> list[Any]:
    """How the state after each step of the window can be made again (from `start`)."""
    out: list[Any] = []
    lineage = tr._lineage(start, batches[0])
    out.append(lineage)
    for b in batches[1:]:
        lineage = tr._extended(lineage, b) if lineage is not None else None
        out.append(lineage)
    return out


def _each(tr: "Trainer", pres: list["Prepared"], lineages: list[Any]
          ) -> list[tuple[TrainState, Any]]:
    """The window's steps submitted one by one (each graph as built: a step reads the
    state of the one before, submitted just before it)."""
    out = []
    for pre, lineage in zip(pres, lineages):
        freeze_heap(tr.client)
        values = submit(tr.client, pre.graph, pre.out_keys)
        loss = StepLoss(values[0].key, tr.client, pre.state.step, pre.workers)
        out.append((tr._finish(pre, loss, values[1:], lineage), loss))
    return out
