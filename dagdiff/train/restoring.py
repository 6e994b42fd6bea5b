"""A Trainer's states after a lost worker: lineage, copies on a second worker, restoring
lost values from a replica or copy, and `Trainer.recover`."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import jax
import numpy as np
from dask.base import tokenize
from distributed import Future, wait

from ..build import pinned
from ..cluster.info import (
    check_open,
    forget_workers,
    lost_workers,
    seen_slots,
)
from ..cluster.targets import Targets
from ..core.footprint import nbytes
from ..core.keys import make_key
from ..errors import ArgumentError, LostStateError, TrainerError
from .recovery import ClientCopy, Lineage, Recovery, copy_task, lost_values, restore
from .state import TrainState, state_identity
from .step_graph import StepModel, stage_address

if TYPE_CHECKING:
    from .fit import InFlight


__all__ = ["Restoring"]

log = logging.getLogger(__name__)

#: bytes per second a copy of the state costs the training: the 12.6 MB of a 4x512 MLP's
#: two stages (parameters and adam state) cost ~40 ms of wall time per copy with a copy
#: every 10 steps (+6.8% at 58 ms steps), ~21 ms each when every step copies, on the
#: 2-core development machine (`benchmarks/bench_train.py`, 2026-12-05); rounded down
COPY_RATE = 2.5e8
#: the default interval between copies is this many times their estimated cost (~5%)
COPY_SHARE = 20


class Restoring:
    """What a Trainer does about lost workers (mixed into `Trainer`): the lineage of
    each state, copies of states on a second worker, restoring lost values from a
    replica or copy, and `recover`."""

    # --- after a lost worker ------------------------------------------------------------
    def recover(self, state: TrainState) -> TrainState:
        """A usable state in place of `state`: `state` itself when every value is still
        held; else, when `state`'s step failed or a value was lost with its worker, the
        same state made again - from the newest state that survives one lost worker
        (another replica's values, their copy, or the client's initial values) by running
        the steps since again, waiting for a lost slot's replacement as `fit` does. Its
        step's new loss is ``state.loss``. Raises `LostStateError` when nothing holds what
        was lost (resume from a checkpoint). The usual loop::

            state, loss = trainer.step(state, x, t)
            try:
                print(float(loss.result()))
            except dd.WorkerLostError:
                state = trainer.recover(state)      # the step, run again
                print(float(state.loss.result()))
        """
        if not isinstance(state, TrainState):
            raise ArgumentError(f"Trainer.recover takes a TrainState, got {type(state).__name__}")
        if self.client is None or not state.is_placed:
            return state
        check_open(self.client)
        t0, wall = time.monotonic(), time.time()
        forget_workers(self.client)
        if self._usable(state):
            return state
        lineage = state.lineage
        if lineage is None or not lineage.batches:
            model = next(iter(self._cache.values()), None)
            if model is None:
                raise TrainerError("Trainer.recover: this trainer never ran a step")
            restored, done = self._restored(state, model, ask=True)
            self.recoveries.append(Recovery(state.step, self._gone(state), done, 0,
                                            time.monotonic() - t0, "recover", wall))
            self._last = restored
            return restored
        model = self._model(lineage.batches[0])
        targets = self._targets(model)            # the live workers: no waiting
        done: tuple[tuple[int, int, str], ...] = ()
        first: LostStateError | None = None
        for way in lineage.ways():                # newest start first
            start = way.start
            if not start.is_placed:
                break
            try:
                start, done = self._restored(start, model, ask=True)
            except LostStateError as e:           # its copies were lost before they landed
                log.debug("dagdiff: cannot restart from step %d: %s", start.step, e)
                first = first or e
                continue
            start = self._protect(start, model)   # a second copy before it is used
            break
        else:
            assert first is not None
            raise first
        lineage = way
        moved = tuple((s, own, to) for s, (own, to) in sorted(targets.moved.items()))
        now = start
        for b in lineage.batches:
            now, _ = self.step(now, *b)
        log.warning("dagdiff: Trainer.recover made step %d's state again from step %d "
                    "(%d step(s) run again)", state.step, start.step, len(lineage.batches))
        self.recoveries.append(Recovery(state.step - 1, self._gone(state), done,
                                        len(lineage.batches) - 1, time.monotonic() - t0,
                                        "recover", wall, moved))
        return now

    def _whole(self, state: TrainState) -> TrainState:
        """`state` with the values lost with their worker taken from another replica or
        their copy (`state` itself when all are held, or when it has no copies): what
        reading a finished state needs, where Dask would run its lost step again."""
        if (not self.recovering or not (state.backup or self._has_copy(state))
                or getattr(state.loss, "worker_lost", False)     # its step failed: its
                or self._usable(state)):                         # own error says so
            return state
        model = next((m for m in self._cache.values() if m.groups == state.groups), None)
        if model is None:
            return state
        restored, done = self._restored(state, model, ask=True)
        return restored

    def _lineage(self, before: TrainState, batch: Sequence[Any]) -> Lineage | None:
        """How the state a step from `before` on `batch` makes can be made again: from
        `before` when it survives any one lost worker (replicas, copies, or the client's
        initial values), else from `before`'s own start, through the batches since."""
        if not self.recovering:
            return None
        if not before.is_placed or before.backup or self._has_copy(before):
            fallback = None
            if before.lineage is not None and not self._landed(before):
                fallback = self._extended(before.lineage, batch)
            return Lineage(dataclasses.replace(before, lineage=None, loss=None),
                           (tuple(batch),), fallback)
        if before.lineage is not None:
            return self._extended(before.lineage, batch)
        return None

    def _extended(self, lineage: Lineage, batch: Sequence[Any]) -> Lineage:
        """`lineage` one step further (`batch`), its fallbacks too while its start's
        copies have not all landed."""
        fallback = lineage.fallback
        if fallback is not None and self._landed(lineage.start):
            fallback = None
        return Lineage(lineage.start, lineage.batches + (tuple(batch),),
                       None if fallback is None else self._extended(fallback, batch))

    @staticmethod
    def _landed(state: TrainState) -> bool:
        """Whether `state`'s values and their copies are all in memory (as far as the
        client has heard): a loss now would leave it restorable."""
        futures = [v for v in (*(state.placed or {}).values(), *(state.backup or {}).values())
                   if hasattr(v, "status")]
        return all(f.status == "finished" for f in futures)

    def _usable(self, state: TrainState) -> bool:
        """Whether every value of `state` is held by a worker (or still being computed by
        a step that did not fail)."""
        assert state.placed is not None
        futures = [v for v in state.placed.values() if hasattr(v, "status")]
        if any(f.status in ("error", "cancelled", "lost") for f in futures):
            return False
        if getattr(state.loss, "worker_lost", False):
            return False
        if any(f.status == "pending" for f in futures):
            return True
        return not lost_values(self.client, state.placed)

    def _gone(self, state: TrainState) -> tuple[str, ...]:
        try:
            return lost_workers(self.client, set((state.where or {}).values()), wait=0.0)
        except Exception:                         # noqa: BLE001 - only for the record
            return ()

    def copy_seconds(self) -> float:
        """The least time between two copies of the state: `copy_interval`, or by default
        `COPY_SHARE` times what sending the whole state (parameters and optimizer state)
        is estimated to take at `COPY_RATE` (a 12.6 MB state: every ~1 s; 200 KB: every
        step that `copy_every` allows)."""
        if self.copy_interval is not None:
            return self.copy_interval
        if self._state_bytes is None:
            params = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in self._template]
            try:
                opt = jax.eval_shape(self.optimizer.init, params)
            except Exception:                     # noqa: BLE001 - only an estimate
                opt = params
            self._state_bytes = sum(nbytes(a) for a in jax.tree_util.tree_leaves((params, opt))
                                    if hasattr(a, "shape"))
        return COPY_SHARE * self._state_bytes / COPY_RATE

    def _to_copy(self, model: "StepModel", targets: Targets, step: int
                 ) -> list[tuple[int, int]]:
        """The (replica, group) values of the state a step makes that get a copy: with one
        replica all of them, once `copy_every` steps and `copy_seconds()` have passed
        since the newest copy (a copy costs the state's bytes through the comms, ~40 ms
        for two stages of 6 MB on two cores: at most ~5% of the steps it covers); with
        more, those of a group whose replicas all run on one worker (e.g. after a loss
        put them together), every step."""
        groups = range(len(model.groups))
        if self.replicas == 1:
            last, then = self._copied
            now = time.monotonic()
            if step < last:                       # steps run again from an older state
                self._copied = (step, then)
            elif step - last >= self.copy_every and now - then >= self.copy_seconds():
                self._copied = (step, now)
                return [(0, g) for g in groups]
            return []
        out = []
        for g in groups:
            stages = [model.group_stage[g] + r * model.p for r in range(self.replicas)]
            if len({targets.target(st) for st in stages}) < 2:
                out.extend((r, g) for r in range(self.replicas))
        return out

    def _copies(self, placed: Mapping[tuple[int, int], Any], model: "StepModel",
                targets: Targets, token: str,
                held: Mapping[str, Collection[str]] | None = None
                ) -> dict[tuple[int, int], Any]:
        """A copy of each value of `placed` on another worker, sent after the step's
        update, off its critical path; none on a one-worker cluster; fetched to the client
        (`ClientCopy`) where one worker of a larger cluster is left. The copy goes where
        a lost stage would be re-placed (`cluster.targets`): the first worker after its
        stage's (slots in order) that runs no stage of the step, else the least busy one,
        so that receiving megabytes does not slow a stage's hops and a recovery finds
        the copy where the stage goes. `held` (key -> addresses holding it, a restored
        value that may not be on its stage's worker): the stage's worker when it does not
        hold the value, else the first of those that does not."""
        slots = targets.slots
        ring = sorted(targets.addresses) if slots else sorted(set(targets.of.values()))
        address = dict(targets.addresses) if slots else {a: a for a in ring}
        load: dict[Any, int] = {}                 # stages each worker runs
        for r in range(self.replicas):
            for g in range(len(model.groups)):
                w = targets.target(model.group_stage[g] + r * model.p)
                load[w] = load.get(w, 0) + 1
        # one live worker of a cluster that had more (the others lost or restarting):
        # the client fetches the copy, so losing that worker too loses nothing
        to_client = (len(ring) == 1 and targets.slots
                     and len(seen_slots(self.client)) > 1)
        out: dict[tuple[int, int], Any] = {}
        for (r, g), fut in placed.items():
            stage = model.group_stage[g] + r * model.p
            home = targets.target(stage)
            if to_client and hasattr(fut, "add_done_callback"):
                out[(r, g)] = ClientCopy(fut)
                continue
            if home not in ring or len(ring) < 2:
                continue
            i = ring.index(home)
            after = ring[i + 1:] + ring[:i]
            order = sorted(after, key=lambda w: (load.get(w, 0), after.index(w)))
            if held is not None:
                have = set(held.get(fut.key, ()))
                order = [w for w in [home, *order] if address[w] not in have] or order
            other = order[0]
            out[(r, g)] = self.client.submit(
                copy_task, fut, key=make_key("backup", f"g{g}", g, token, stage, r),
                **pinned(other, slots))
        return out

    def _protect(self, state: TrainState, model: "StepModel") -> TrainState:
        """`state` (just recovered after a loss) with every value on two live workers:
        a value only one worker holds gets a fresh copy on another (its stage's worker,
        else the next), so that another loss right after this one loses nothing."""
        assert state.placed is not None
        targets = self._targets(model)
        futures = [v for v in state.placed.values() if hasattr(v, "key")]
        held = self.client.who_has(futures) if futures else {}
        single = {rg: v for rg, v in state.placed.items()
                  if hasattr(v, "key") and len(held.get(v.key, ())) < 2}
        # a new key whenever the holders differ (a copy made before this loss is not one)
        token = tokenize("protect", state_identity(state),
                         sorted((str(k), sorted(v)) for k, v in held.items()),
                         ensure_deterministic=False)[:16]
        copies = self._copies(single, model, targets, token, held)
        if set(single) - set(copies):
            return state                      # one live worker: nowhere to copy to
        self._copied = (state.step, time.monotonic())
        # a value two workers hold is its own copy (dagdiff keeps the replicas: no AMM
        # ReduceReplicas); restore finds it while either of them lives
        backup = {rg: copies.get(rg, v) for rg, v in state.placed.items()}
        return dataclasses.replace(state, backup=backup)

    def _restored(self, state: TrainState, model: "StepModel", ask: bool = False
                  ) -> tuple[TrainState, tuple[tuple[int, int, str], ...]]:
        """`state` with any value lost with its worker replaced from a replica or copy
        (LostStateError when none holds it); `state` itself when nothing is lost. `ask`:
        ask the scheduler which values it still has (after a loss, before the client's
        futures hear of it), instead of reading the futures' status."""
        assert state.placed is not None
        bad = [f for f in state.placed.values() if getattr(f, "status", "finished") == "error"]
        if not bad and getattr(state.loss, "worker_lost", False):
            bad = [state.loss]                # its step failed: its values are not its own
        if bad and not ask:
            why = (f"{type(bad[0].exception()).__name__}: {str(bad[0].exception())[:300]}"
                   if bad[0].status == "error" else "a worker it ran on was lost")
            raise TrainerError(
                f"this state (step {state.step}) is the result of a step that failed ({why}); "
                "after a lost worker, `state = trainer.recover(state)` makes it again, else "
                "step from the state before it (trainer.fit does both for you)")
        if not ask and all(getattr(f, "status", "finished") in ("finished", "pending")
                           for f in state.placed.values()):
            return state, ()
        if not self.recovering:
            raise LostStateError(
                f"part of this state (step {state.step}) was lost with its worker, and the "
                "Trainer has recover=False; resume from a checkpoint (dd.load)")
        kept = state.backup or {}
        copies = {rg: v for rg, v in kept.items() if hasattr(v, "key")}
        targets = self._targets(model)

        def rescatter(r: int, g: int) -> Any:     # the client has it: scatter it again
            value = kept.get((r, g))
            if isinstance(value, ClientCopy):
                if value.status != "finished":
                    return None                   # its fetch did not land
                value = value.value
            elif value is None or hasattr(value, "key"):
                return None
            return self._scatter(value,
                                 stage_address(targets, model.group_stage[g] + r * model.p))

        placed, done = restore(self.client, state.placed, copies, model.group_stage, model.p,
                               state.where, rescatter)
        if done:
            log.warning("dagdiff: Trainer restored %s of step %d after a lost worker",
                        ", ".join(f"replica {r} group {g} from {src}" for r, g, src in done),
                        state.step)
        return dataclasses.replace(state, placed=placed), done

    def _with_copy(self, state: TrainState, batch: Sequence[Any]) -> TrainState:
        """`state` with a copy of its values on other workers, when it is placed, has
        none, and the trainer recovers: where `fit` can go back to."""
        if (not self.recovering or self.client is None or not state.is_placed
                or self._has_copy(state) or state.backup):
            return state
        model = self._model(batch)
        token = tokenize(state_identity(state), ensure_deterministic=False)[:16]
        assert state.placed is not None
        copies = self._copies(state.placed, model, self._targets(model), token)
        if copies:
            self._copied = (state.step, time.monotonic())
        return dataclasses.replace(state, backup=copies)

    def _await_copies(self, state: TrainState, timeout: float = 60.0) -> None:
        """Wait (up to `timeout` s) until `state`'s copies on other workers are in memory;
        a copy that fails (its source's worker lost meanwhile) is left to recovery."""
        futures = [v for v in (state.backup or {}).values() if isinstance(v, Future)]
        if not futures or self.client is None:
            return
        try:
            with self.client.as_current():           # the trainer's client, default or not
                wait(futures, timeout=timeout)
        except Exception as e:                    # noqa: BLE001 - recovery reads them later
            log.info("dagdiff: the copies of step %d's state did not all land (%s: %s)",
                     state.step, type(e).__name__, e)

    def _has_copy(self, state: TrainState) -> bool:
        """Whether every value of `state` has a second copy on another worker: another
        replica's on a different worker, or a copy step's. A state made inside a window of
        steps has no values a client can hold (its values are the next program's to
        read), so it has none."""
        if state.in_window:
            return False
        backup, where = state.backup or {}, state.where or {}
        for r, g in state.placed or {}:
            if hasattr(backup.get((r, g)), "key") or isinstance(backup.get((r, g)), ClientCopy):
                continue
            if not any(where.get((r2, g2)) not in (None, where.get((r, g)))
                       for r2, g2 in where if g2 == g and r2 != r):
                return False
        return bool(state.placed)

    def _recoverable(self, entry: "InFlight", base: TrainState,
                     history: list[tuple[tuple[Any, ...], TrainState | None]]
                     ) -> tuple[TrainState, list[tuple[Any, ...]],
                                tuple[tuple[int, int, str], ...]]:
        """The newest state that can be restored: the failed step's input, else the
        newest finished state with copies (every `copy_every` steps) or `base`, else a
        state `base` was made from (its lineage), and the batches of the steps after it,
        to run again."""
        candidates: list[tuple[TrainState, list[tuple[Any, ...]]]] = [(entry.before, [])]
        for j in range(len(history) - 1, -1, -1):
            kept = history[j][1]
            if kept is not None:
                candidates.append((kept, [b for b, _ in history[j + 1:]]))
        since_base = [b for b, _ in history]
        candidates.append((base, since_base))
        # `base` lost with its copies (fit started from a step loop's newest state, a
        # worker lost since): the states it can be made from, through its own steps
        if base.lineage is not None:
            candidates += [(way.start, [*way.batches, *since_base])
                           for way in base.lineage.ways()]
        first: Exception | None = None
        for start, replay in candidates:
            if not start.is_placed:               # the first step: it is placed again
                return start, replay, ()
            if start.in_window:                   # no values to restore from
                continue
            model = self._model(entry.batch)
            try:
                restored, done = self._restored(start, model, ask=True)
            except LostStateError as e:
                log.debug("dagdiff: cannot restart from step %d: %s", start.step, e)
                first = first or e
                continue
            return restored, replay, done
        raise first or LostStateError(
            f"step {entry.before.step}: no state to go back to (each one was made inside a "
            "window of steps); run fit with window=1")
