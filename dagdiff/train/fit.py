"""`Trainer.fit`: a run of steps with two (windows of them) in flight, recovery from lost
workers, Ctrl-C."""
from __future__ import annotations

import dataclasses
import logging
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import dask
import jax
from distributed import Future

from ..cluster.info import (
    forget_workers,
    lost_workers,
    may_be_a_lost_worker,
)
from ..errors import (ArgumentError, LayerShapeError, LostStateError, MicrobatchError,
                      PlacementError, TracerError, TrainerError, WorkerLostError)
from ..runtime.tasks import snapshot_batch
from .recovery import Recovery, WindowLoss
from .state import TrainState
from .window import can_share, submit_window

if TYPE_CHECKING:
    from .trainer import Trainer


__all__ = ["FitRun", "InFlight", "NoBar", "AutoWindow"]

log = logging.getLogger(__name__)

#: how the note `fit` adds to the error that stopped it begins
_STOPPED = "dagdiff: Trainer.fit stopped"


class AutoWindow:
    """``window="auto"``: how many steps `fit` submits as one computation. The first
    steps go one by one; from the time between the ends of the steps after the first
    (compilation) the window is chosen so that one spans about `seconds` (dask config
    ``dagdiff.fit.window-seconds``, default 0.5 s), at most `MOST` (64) steps and
    `MAX_BYTES` of batches (a window's batches travel in its graph): where a
    step is mostly Dask's fixed cost, windows amortize it; where a step takes longer
    than `seconds`, steps stay one by one. A window's steps end together, so the loss
    and progress bar move every `seconds`, and a failure runs at most that much again.
    Windows make steps faster than the one-by-one steps the choice was timed on: once
    two windows' worth of steps have ended in windows, the window grows (once) to span
    `seconds` of those steps. The choice is kept on the Trainer per batch signature and
    `seconds`: a later `fit` of such batches (the next epoch, a re-run cell) starts with
    it."""

    #: finished steps timed before choosing (the first, with compilation, is not counted)
    TIMED = 3
    #: the most steps one window may hold (the tiny job of `bench_peers.py`, 256 steps in
    #: windows of 16 / 32 / 64: 7.2 / 6.9 / 6.4 ms a step: each window's submission and
    #: its end cost the client, scheduler and workers ~35 ms of CPU beside the steps)
    MOST = 64
    #: the most bytes of batch arrays one window may hold
    MAX_BYTES = 64 * 2**20

    def __init__(self, seconds: float | None = None, most: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = float(dask.config.get("dagdiff.fit.window-seconds", 0.5)
                             if seconds is None else seconds)
        self.most = self.MOST if most is None else most
        self.size = 1
        self.chosen = False
        self.refined = False
        self._clock = clock
        self._ends: list[float] = []
        self._since: list[float] = []            # step ends since the choice
        #: where the choice is kept (`start`): a Trainer's dict, and the key in it
        self._kept: dict[tuple[Any, float], int] | None = None
        self._key: Any = None

    def start(self, kept: dict[tuple[Any, float], int], batch_key: Any,
              batch: Sequence[Any]) -> None:
        """The first batch is `batch`, of signature `batch_key`: take an earlier fit's
        choice for it from `kept`, or keep this one's there once made."""
        self._kept, self._key = kept, (batch_key, self.seconds)
        nbytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(batch))
        self.most = max(1, min(self.most, self.MAX_BYTES // max(nbytes, 1)))
        if self._key in kept:
            self.size, self.chosen = kept[self._key], True

    def step_ended(self) -> None:
        """One more step ended (in order): time it; choose once enough have, and grow
        the window once when windowed steps turn out faster."""
        if self.refined:
            return
        if self.chosen:
            self._since.append(self._clock())
            w = self.size
            if w > 1 and len(self._since) >= 3 * w:
                # the steps after the first w (those submitted before the choice, and
                # the first window): two windows' worth, in windows
                per_step = (self._since[-1] - self._since[w - 1]) / (len(self._since) - w)
                self.refined = True
                self._choose(per_step, grow=True)
            elif w == 1:
                self.refined = True
            return
        self._ends.append(self._clock())
        if len(self._ends) > self.TIMED + 1:
            gaps = [b - a for a, b in zip(self._ends[1:], self._ends[2:])]
            self.chosen = True
            self._choose(sorted(gaps)[len(gaps) // 2])

    def _choose(self, per_step: float, grow: bool = False) -> None:
        """The window that spans `seconds` of steps taking `per_step` (within `most`;
        `grow`: only a larger one than now); kept for later fits."""
        size = max(1, min(self.most, int(self.seconds / max(per_step, 1e-6))))
        if grow and size <= self.size:
            return
        self.size = size
        if self._kept is not None:
            self._kept[self._key] = self.size
        log.info("dagdiff: Trainer.fit: %.1f ms per step%s, window=%d", 1e3 * per_step,
                 " in windows" if grow else "", self.size)


@dataclass(frozen=True)
class InFlight:
    """A submitted step in `fit`: its loss, the states before and after it, its batch, and
    the recovery it is the retry of (`seconds` holds the failure's time until it ends)."""

    loss: Any
    before: TrainState
    after: TrainState
    batch: tuple[Any, ...]
    recovery: Recovery | None = None


class NoBar:
    """What `fit` updates when no progress bar is shown."""

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def result_of(x: Any) -> Any:
    return x.result() if hasattr(x, "result") else x


class FitRun:
    """One `Trainer.fit`: its steps in flight (two at a time), the losses of those that
    ended, where recovery goes back to, and what it does when a worker is lost (run the
    failed step again at once on the live workers, from the newest state it can restore)
    or on Ctrl-C (keep the finished steps)."""

    def __init__(self, trainer: "Trainer", state: TrainState, bar: Any,
                 window: int | str = 1) -> None:
        self.trainer = trainer
        self.bar = bar
        #: ``window="auto"``: chooses `window` from the first steps' times
        self.auto = AutoWindow() if window == "auto" and can_share(trainer) else None
        #: steps submitted as one computation (`dagdiff.train.window`)
        self.window: int = 1 if window == "auto" else int(window)
        self.pending: list[InFlight] = []
        self.losses: list[float] = []
        #: the last state whose step ended
        self.finished = state
        #: where to go back to: `base`, a state with copies, and per finished step since,
        #: its batch and (only when it has copies) its state; other states are not kept
        self.base = state
        self.history: list[tuple[tuple[Any, ...], TrainState | None]] = []
        self.retries = 0

    def run(self, batches: Iterable[Sequence[Any]], steps: int | None
            ) -> tuple[TrainState, list[float]]:
        """Submit the batches' steps, two windows in flight, and wait for them; (state,
        losses)."""
        tr, pending = self.trainer, self.pending
        group: list[tuple[Any, ...]] = []
        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                if not isinstance(batch, (tuple, list)):
                    raise ArgumentError(
                        f"Trainer.fit takes an iterable of batches, each a tuple of the loss "
                        f"function's batch arguments (e.g. [(x0, t0), (x1, t1), ...]); batch "
                        f"{i} is a {type(batch).__name__}")
                if i == 0:
                    self.finished = self.base = tr._with_copy(self.finished, batch)
                    if self.auto is not None:
                        self.auto.start(tr._windows, tr._batch_key(batch), batch)
                        self.window = self.auto.size
                # a loader may refill one NumPy buffer for every batch: the steps, and
                # their lineage, keep the batch as it is now
                group.append(snapshot_batch(batch))
                if len(group) == self.window:
                    self.submit(group)
                    group = []
            if group:
                self.submit(group)
            while pending:
                self.take_one()
            if self.losses:
                # the state handed back outlives the fit (a notebook keeps it while the
                # cluster scales down): it gets a copy on another worker when it has none,
                # and fit returns once its copies are there (a worker scaled away right
                # after could otherwise take a copy's source with it)
                self.keep_final(batch)
        except KeyboardInterrupt:
            self.interrupted()
            # this frame, kept alive by the traceback, must not hold the in-flight futures
            group = []
            raise
        except Exception as e:
            group = []
            self.stopped(e)
            raise
        self.bar.close()
        tr._last = self.finished
        if steps is not None and len(self.losses) < steps:
            warnings.warn(f"Trainer.fit: the batches ran out after {len(self.losses)} of "
                          f"steps={steps} steps; pass more batches (e.g. "
                          "itertools.cycle(batches)) to train longer", stacklevel=3)
        return self.finished, self.losses

    def keep_final(self, batch: Sequence[Any]) -> None:
        """Give the final state a copy on another worker (when it has none) and wait for
        the copies to land. A worker lost meanwhile (its values were the copies' source,
        or it held a copy) leaves the state without a whole copy: it is made again as
        `Trainer.recover` makes it (from the newest state that survives, through the
        steps since) and copied again, up to `max_retries` times."""
        tr = self.trainer
        for _ in range(tr.max_retries + 1):
            self.finished = tr._with_copy(self.finished, batch)
            tr._await_copies(self.finished)
            state = self.finished
            if not tr.recovering or not any(
                    getattr(f, "status", None) in ("error", "cancelled", "lost")
                    for f in (*(state.placed or {}).values(), *(state.backup or {}).values())
                    if isinstance(f, Future)):
                return                            # no copy failed, no value was lost
            loss = self.finished.loss
            remade = tr.recover(self.finished)
            if remade is self.finished:           # its values are held: a copy was lost
                remade = dataclasses.replace(remade, backup=None)
            else:
                log.warning("dagdiff: Trainer.fit made its final state (step %d) again: a "
                            "worker was lost while its copies were made", remade.step)
            self.finished = dataclasses.replace(remade, loss=float(result_of(remade.loss))
                                                if remade.loss is not None else loss)
        raise LostStateError(
            f"Trainer.fit: the final state (step {self.finished.step}) lost its copies "
            f"{tr.max_retries + 1} times in a row (workers keep being lost); "
            "trainer.recover(state) makes it again once the cluster is stable")

    def submit(self, group: list[tuple[Any, ...]]) -> None:
        """Submit the steps of `group` (one window) after those in flight, then wait for
        the oldest while more than two windows are in flight."""
        tr, pending = self.trainer, self.pending
        before = pending[-1].after if pending else self.finished
        try:
            made = submit_window(tr, before, group)
        except (ArgumentError, MicrobatchError, LayerShapeError, TracerError,
                PlacementError):
            if len(group) == 1:
                raise
            # a batch of this window cannot be a step (a last batch that does not split
            # into the microbatches): the batches before it run, one window each
            for one in group:
                self.submit([one])
            return
        except (LostStateError, TrainerError):
            if not pending or not tr.recovering:
                raise
            # the state these steps start from was lost (a worker went away) or failed
            # before its own step ended: that step's failure goes through recovery
            # first, and these steps start from the state it gives
            while pending:
                self.take_one()
            before = self.finished
            made = submit_window(tr, before, group)
        now = before
        for (after, loss), b in zip(made, group):
            pending.append(InFlight(loss, now, after, b))
            now = after
        # a Ctrl-C while waiting below keeps this frame in its traceback: it must not hold
        # the in-flight steps' futures (released futures stop their programs)
        made = before = now = after = loss = None          # noqa: F841
        while len(pending) > 2 * self.window:    # keep two windows in flight
            self.take_one()

    def interrupted(self) -> None:
        """Ctrl-C: keep the steps that already ended, let go of the others (released
        futures stop their programs on the workers; nothing here may hold them), and make
        the last finished state the trainer's latest."""
        pending = self.pending
        while pending and getattr(pending[0].loss, "status", "finished") == "finished":
            self.take_one()
        pending.clear()
        self.history.clear()
        self.trainer._last = self.finished
        self.bar.close()
        warnings.warn(f"Trainer.fit interrupted after {len(self.losses)} finished step(s); "
                      f"trainer.fit(...) goes on from step {self.finished.step} (the state "
                      "of the last finished step)", stacklevel=4)

    def stopped(self, error: Exception) -> None:
        """An error ended the fit (a batch that cannot be a step, such as a last batch
        that does not split into the microbatches; a failing model): the steps submitted
        before it end as usual (unless one fails too), the last finished state becomes the
        trainer's latest, and the error says where the fit stopped and how to go on."""
        try:
            while self.pending:
                self.take_one()
        except Exception:                    # noqa: BLE001 - the first error is raised
            self.pending.clear()
        self.history.clear()
        self.trainer._last = self.finished
        self.bar.close()
        # the error's traceback keeps the frames it went through, and their locals hold
        # the failed steps' futures; the futures' state holds the error: a cycle that
        # kept the failed program tasks on the workers until the garbage collector ran
        traceback.clear_frames(error.__traceback__)
        try:
            # the same exception object comes back when the same failed step is asked
            # again (a fit re-run from the same state): one note, this fit's
            notes = getattr(error, "__notes__", None)
            if isinstance(notes, list):
                notes[:] = [n for n in notes if not str(n).startswith(_STOPPED)]
            n = len(self.losses)
            error.add_note(
                f"dagdiff: Trainer.fit stopped after {n} finished step(s) (this fit's "
                f"batches 0-{n - 1} ran); trainer.fit(...) without state= goes on from "
                f"step {self.finished.step} (the state of the last finished step)"
                if n else "dagdiff: Trainer.fit stopped before its first step ended; the "
                "trainer's latest state is the one it started from")
        except Exception:                    # noqa: BLE001 - a frozen exception
            pass

    def take_one(self) -> None:
        """Wait for the oldest step in flight: its loss, or recovery when it failed."""
        tr, entry = self.trainer, self.pending[0]
        try:
            value = float(result_of(entry.loss))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:                    # noqa: BLE001 - classified below
            self.recover(e)
            return
        self.pending.pop(0)
        self.losses.append(value)
        # the finished state keeps its loss as a number, not as a Future: a held loss
        # whose worker is lost later would make Dask run that step's programs again
        # alone (they fail: the step was built for the lost worker), and distributed
        # then marks the step's other results erred when a later graph reads them (its
        # update_graph blames a dependency that erred), taking a state that was whole
        after = dataclasses.replace(entry.after, loss=value)
        self.pending[:] = [dataclasses.replace(e, before=after) if e.before is entry.after
                           else e for e in self.pending]
        self.finished = after
        if tr.recovering:
            history = self.history
            history.append((entry.batch, after if tr._has_copy(after) else None))
            anchors = [j for j, (_, st) in enumerate(history) if st is not None]
            if len(anchors) > 2:                  # keep the two newest copies
                self.base = history[anchors[-2]][1]  # type: ignore[assignment]
                del history[:anchors[-2] + 1]
        self.retries = 0
        if self.auto is not None:
            self.auto.step_ended()
            self.window = self.auto.size
        if entry.recovery is not None:
            tr.recoveries.append(dataclasses.replace(
                entry.recovery, seconds=time.monotonic() - entry.recovery.seconds))
        self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}")
        self.bar.update(1)

    def split_window(self) -> bool:
        """The oldest step failed, and with it the rest of its window (one computation:
        a layer failing in one step fails them all): run the steps in flight again one
        at a time from the last finished state, so that those before the failing step
        end and keep their state, and the failing step raises its error alone; False
        when the oldest step was not part of a window of several."""
        pending = self.pending
        loss = pending[0].loss
        if not isinstance(loss, WindowLoss) or sum(
                isinstance(e.loss, WindowLoss) and e.loss.key == loss.key
                for e in pending) < 2:
            return False
        todo = [e.batch for e in pending]
        pending.clear()                           # let go of the failed window's futures
        self.window, self.auto = 1, None          # the rest of this fit: one by one
        log.info("dagdiff: a window of Trainer.fit failed; its steps run again one at a "
                 "time from step %d", self.finished.step)
        now = self.finished
        for b in todo:
            after, loss = self.trainer.step(now, *b)
            pending.append(InFlight(loss, now, after, b))
            now = after
        return True

    def recover(self, error: Exception) -> None:
        """The oldest step failed: when a worker was lost, run it (and those after it)
        again on the live workers from the newest state that can be restored; when the
        model failed in a window, run the window's steps again one by one
        (`split_window`); else raise."""
        tr, pending = self.trainer, self.pending
        entry = pending[0]
        if not tr.recovering or tr.client is None or self.retries >= tr.max_retries:
            if self.split_window():
                return
            raise error
        t0, wall = time.monotonic(), time.time()
        # the workers the step ran on, those of the state it read, and the one a program
        # run again on a replacement was built for (Dask ran an earlier step's program
        # again when a value the step reads was lost with its worker)
        ran_on = {*(entry.after.where or {}).values(), *(entry.before.where or {}).values()}
        if getattr(error, "address", None):
            ran_on.add(error.address)             # type: ignore[attr-defined]
        gone = (error.workers if isinstance(error, WorkerLostError)  # the loss found them
                else lost_workers(tr.client, ran_on,
                                  wait=10.0 if may_be_a_lost_worker(error) else 0.0))
        if not gone:                              # the model failed, not a worker
            if self.split_window():
                return
            raise error
        self.retries += 1
        forget_workers(tr.client)
        log.warning("dagdiff: step %d failed after losing worker(s) %s (%s: %s); "
                    "running it again", entry.before.step, ", ".join(gone),
                    type(error).__name__, str(error)[:200])
        if entry.recovery is not None:            # its retried step was lost too
            tr.recoveries.append(dataclasses.replace(
                entry.recovery, seconds=time.monotonic() - entry.recovery.seconds,
                error=entry.recovery.error + " (the retried step was lost again: see "
                "the next recovery)"))
        todo = [e.batch for e in pending]
        pending.clear()                           # let go of the failed steps' futures
        model = tr._model(entry.batch)
        targets = tr._targets(model)              # the live workers: no waiting
        start, replay, restored = tr._recoverable(entry, self.base, self.history)
        if start.is_placed:
            # a second copy of what was restored, before anything depends on it; the
            # batches since `start` are what `base` needs from now on
            protected = tr._protect(start, model)
            if protected is not start:
                start = self.base = protected
                self.history[:] = [(b, None) for b in replay]
        moved = tuple((s, own, to) for s, (own, to) in sorted(targets.moved.items()))
        now = start
        for b in replay:                          # finished steps, run again
            now, _ = tr.step(now, *b)
        for i, b in enumerate(todo):
            after, loss = tr.step(now, *b)
            rec = None
            if i == 0:
                rec = Recovery(entry.before.step, gone, restored, len(replay), t0,
                               f"{type(error).__name__}: {str(error)[:500]}", wall, moved)
            pending.append(InFlight(loss, now, after, b, rec))
            now = after
