"""Surviving a lost worker: where each stage's training state has a second copy, how to tell
a lost worker from a failing model, and how to put a state back together after a loss.

A Trainer state's values live on their stage's worker. With data-parallel replicas the
other replicas hold identical values; without, each step sends a copy of every stage's
new state to another worker (`copy_task`, off the step's critical path); while only one
worker of a larger cluster lives (the others restarting), the copy is fetched to the client
instead (`ClientCopy`). When a worker is lost, the values it held are restored from a replica or that copy (`restore`), and the
step runs again from there: same inputs, same result, no update applied twice.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

from distributed import Future

from ..cluster.info import lost_workers, may_be_a_lost_worker, on_worker_removed
from ..errors import DirectDispatchError, LostStateError, WorkerLostError


__all__ = ["Recovery", "Placement", "Lineage", "StepLoss", "WindowLoss", "ClientCopy",
           "copy_task", "lost_values", "restore"]


@dataclass(frozen=True)
class Recovery:
    """One recovered failure of `Trainer.fit`: the step that ran again, the workers that
    were lost, where each lost (replica, group) state came from ("replica r" or "copy"),
    how many finished steps were run again to get back to the failed one, the seconds
    from the failure to the retried step's end, the error that stopped the step, and
    when (``time.time()``) the failure reached the trainer."""

    step: int
    lost_workers: tuple[str, ...]
    restored: tuple[tuple[int, int, str], ...]
    replayed: int
    seconds: float
    error: str
    failed_at: float = 0.0          # time.time() when the failure reached the trainer
    #: (stage, its own slot, the live slot it ran on instead) for each stage re-placed
    #: because its worker was lost (it goes back when the replacement joins)
    moved: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where stages ran from `step` on, when that changed: `moved`, (stage, own slot, live
    slot it runs on) for each stage away from its own slot (empty: every stage is back);
    `joined`, (stage, slot it ran on, slot it runs on now) for each stage that spread
    out to a worker that joined the cluster (a slot it had never seen)."""

    step: int
    moved: tuple[tuple[int, str, str], ...]
    joined: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True)
class Lineage:
    """How a Trainer state can be made again: from `start`, a state that survives the loss
    of any one worker (placed with another replica or a copy of each value, or the initial
    state the client holds), by running the steps of `batches` in order; else, when a loss
    came before `start`'s copies landed, by way of `fallback`."""

    start: Any                                   # a TrainState, without a lineage of its own
    batches: tuple[tuple[Any, ...], ...]
    #: another way to the same state, from an older start: kept while `start`'s copies
    #: are still on their way (a loss before they land takes them too)
    fallback: "Lineage | None" = None

    def ways(self) -> list["Lineage"]:
        """This lineage and its fallbacks, newest start first."""
        out, now = [], self
        while now is not None:
            out.append(now)
            now = now.fallback
        return out


class StepLoss(Future):
    """A training step's loss: a `distributed.Future` whose `result` raises
    `WorkerLostError` (naming the step and the lost workers, and the way back) when the
    step failed because a worker it ran on was lost."""

    def __init__(self, key: Any, client: Any, step: int, workers: Collection[str]) -> None:
        super().__init__(key, client)
        self.step = step
        self.workers = tuple(sorted(set(workers)))
        #: whether `result` found the step failed by a lost worker
        self.worker_lost = False
        try:
            _PENDING.setdefault(client, weakref.WeakSet()).add(self)
        except TypeError:                     # not weak-referenceable (a stand-in client)
            pass

    #: the client inbox the step's loss is pushed to (`take_pushed`), and what came
    _inbox: Any = None
    _pushed: tuple[Any] | None = None

    def take_pushed(self, inbox: Any) -> None:
        """Take this loss from `inbox` (`runtime.direct.inbox.ClientInbox`, which expects
        it) when it is pushed there before the future finishes."""
        self._inbox = inbox
        weakref.finalize(self, inbox.forget, [str(self.key)])

    def result(self, timeout: float | None = None) -> Any:
        box, self._inbox = self._inbox, None
        if box is not None:
            start = time.monotonic()
            got = box.take([str(self.key)], [self], timeout)
            if got is not None:
                self._pushed = (got[str(self.key)],)
            elif timeout is not None:               # what is left of it for Dask
                timeout = max(0.0, timeout - (time.monotonic() - start))
        if self._pushed is not None:
            return self._pushed[0]
        try:
            try:
                return super().result(timeout)
            except AttributeError as e:
                # distributed marked the key erred without an exception (seen when a
                # worker holding the step's values was lost mid-recovery): a loss, maybe
                if self.status != "error" or "with_traceback" not in str(e):
                    raise
                raise DirectDispatchError(
                    f"Trainer step {self.step}'s loss {self.key} erred and distributed "
                    "reported no exception for it") from None
        except Exception as e:                # noqa: BLE001 - re-raised unless a loss
            if not may_be_a_lost_worker(e) or not self.workers:
                raise
            try:
                gone = lost_workers(self.client, self.workers, wait=10.0)
            except Exception:                 # noqa: BLE001 - the client itself is gone
                raise e from None
            if not gone:
                raise
            self.worker_lost = True
            raise WorkerLostError(
                f"Trainer step {self.step} failed: worker(s) {', '.join(gone)} it ran on "
                f"were lost ({type(e).__name__}: {str(e)[:300]}). Run it again from a "
                "surviving copy with `state = trainer.recover(state)` (the state this step "
                "returned; its new loss is `state.loss`), or use trainer.fit, which "
                "recovers by itself.", self.step, gone) from e


class WindowLoss(StepLoss):
    """The loss of step `index` of a window of steps submitted as one computation
    (`Trainer.fit(window=)`): a `StepLoss` of the window's output (the window's losses),
    whose `result` is this step's. The window's steps share `got`: once one of them has
    the losses, the others read them there (the output's worker may be lost after the
    first step took its loss: its steps ended, and their losses must not fail then)."""

    def __init__(self, key: Any, client: Any, step: int, workers: Collection[str],
                 index: int, got: list[Any] | None = None) -> None:
        super().__init__(key, client, step, workers)
        self.index = index
        self.got = got if got is not None else []

    def result(self, timeout: float | None = None) -> Any:
        if not self.got:
            self.got.append(super().result(timeout))
        return self.got[0][self.index]


_PENDING: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[StepLoss]]" = \
    weakref.WeakKeyDictionary()


def _fail_steps_on(client: Any, address: str) -> Any:
    """The scheduler removed the worker at `address`: every step of `client` still running
    that ran on it fails now (its loss is cancelled; `result` raises `WorkerLostError`)
    instead of waiting for Dask to recompute the lost part on the worker's replacement,
    which a direct-dispatch step cannot do."""
    steps = [f for f in list(_PENDING.get(client, ())) if address in f.workers
             and f.status == "pending"]
    if not steps:
        return None
    return client.cancel(steps, asynchronous=True,
                         reason=f"worker {address}, which the step ran on, was lost")


on_worker_removed(_fail_steps_on)


class ClientCopy:
    """A copy of a state value fetched to the client in the background, when no second
    live worker can hold one (every other worker of the cluster is lost or restarting):
    a loss of the last worker then costs a scatter of it, not the state. Its `status`
    reads like a Future's ("pending" until the value is here, "finished", or "error"
    when the fetch failed, e.g. the worker was lost first)."""

    def __init__(self, future: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._here = threading.Event()
        future.add_done_callback(self._fetch)   # run in a thread of the client's

    def _fetch(self, future: Any) -> None:
        try:
            self.value = future.result()
        except BaseException as e:            # noqa: BLE001 - a copy that did not land
            self.error = e
        finally:
            self._here.set()

    @property
    def status(self) -> str:
        if not self._here.is_set():
            return "pending"
        return "finished" if self.error is None else "error"

    def __repr__(self) -> str:
        return f"<ClientCopy: {self.status}>"


def copy_task(value: Any) -> Any:
    """A copy of `value` on the worker this task runs on (Dask moves the value there)."""
    return value


def _alive(client: Any, futures: Collection[Any]) -> set[str]:
    """Keys of `futures` that some worker still holds in memory."""
    futures = [f for f in futures   # cancelled, errored or lost ones are gone
               if hasattr(f, "key") and f.status in ("finished", "pending")]
    if not futures:
        return set()
    who = client.who_has(futures)          # (given keys, it answers nothing)
    return {f.key for f in futures if who.get(f.key)}


def lost_values(client: Any, placed: Mapping[tuple[int, int], Any]) -> list[tuple[int, int]]:
    """The (replica, group) entries of a placed state whose value no worker holds."""
    alive = _alive(client, [v for v in placed.values() if hasattr(v, "key")])
    return sorted(rg for rg, v in placed.items()
                  if hasattr(v, "key") and (v.key not in alive or v.status != "finished"))


def restore(client: Any, placed: Mapping[tuple[int, int], Any],
            backup: Mapping[tuple[int, int], Any] | None, group_stage: list[int], p: int,
            where: Mapping[tuple[int, int], str] | None = None,
            rescatter: Callable[[int, int], Any] | None = None
            ) -> tuple[dict[tuple[int, int], Any], tuple[tuple[int, int, str], ...]]:
    """Replace every lost value of `placed` by an identical one still held somewhere: the
    same group of another replica, else its copy in `backup`, else `rescatter(replica,
    group)`, a new Future of the client's copy (the initial state, or a `ClientCopy`;
    None where the client has none). Returns the new mapping and
    (replica, group, source) per replaced entry; raises `LostStateError` naming what is
    lost and how to resume when neither exists. (The next step reads a replaced value
    from wherever it is: Dask moves it to the stage's worker.)"""
    lost = lost_values(client, placed)
    if not lost:
        return dict(placed), ()
    alive_backup = _alive(client, list((backup or {}).values()))
    new = dict(placed)
    done: list[tuple[int, int, str]] = []
    missing: list[str] = []
    lost_set = set(lost)
    for r, g in lost:
        other = next((r2 for (r2, g2) in placed if g2 == g and r2 != r
                      and (r2, g2) not in lost_set), None)
        if other is not None:
            new[(r, g)] = placed[(other, g)]
            done.append((r, g, f"replica {other}"))
            continue
        copy = (backup or {}).get((r, g))
        if hasattr(copy, "key") and copy.key in alive_backup:
            new[(r, g)] = copy
            done.append((r, g, "copy"))
            continue
        fresh = rescatter(r, g) if rescatter is not None else None
        if fresh is not None:
            new[(r, g)] = fresh
            done.append((r, g, "client"))
            continue
        stage = group_stage[g] + r * p
        missing.append(f"stage {stage} (replica {r}, parameter group {g}"
                       + (f", last on {where[(r, g)]}" if where and (r, g) in where else "")
                       + ")")
    if missing:
        raise LostStateError(
            f"the training state of {', '.join(missing)} was lost with its worker, and no "
            "other replica or copy holds it (copies are made when the Trainer has "
            "recover=True and the cluster has more than one worker). Resume from the last "
            "checkpoint: state = dd.load(path); trainer.fit(batches, state=state)")
    return new, tuple(done)
