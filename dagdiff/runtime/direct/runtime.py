"""The direct-dispatch runtime of one worker: the extension that routes messages to runs
and runs programs.

A `DirectRuntime` is a worker extension (``worker.extensions["dagdiff"]``), installed by
dagdiff's worker plugin or ``--preload dagdiff``. It owns the worker's `Transport`, the
registry of runs on this worker (each a `run.ProgramRun`, which owns its inbox, its
interpreter, its waits and its outbox), the handlers other workers and the scheduler call
(a run's status, a lost peer), and the log of what ran here.

A *run* is one execution of a step's programs. Its id is the step's token plus the
nonce its program tasks carry (a `RunNonce`): dagdiff's scheduler plugin stamps a fresh
one on every program task as the task is submitted or run again (`stamp_run_nonces`), the
same one on the programs of one step, so computing a step again runs its programs under
a new nonce and the runs never mix, even when Dask reuses every key. No task makes it and
no worker waits for it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed import Reschedule, get_worker, secede
from distributed.comm import connect
from distributed.metrics import time as now

from ...errors import DirectDispatchError
from ..internals import scheduler_delay, worker_task
from ..live import ActionReporter
from .inbox import INBOX_OP, InboxEnds
from .messages import End, Failure, Message
from .program import Program
from .results import Export, LocalImport, ProgramResult
from .run import ProgramRun, cause_of, exception_of
from .transport import STATUS_OP, WRITE_TIMEOUT, DecodeError, Transport


__all__ = ["EXTENSION", "DirectRuntime", "install", "runtime",
           "run_program", "run_programs", "new_nonce", "RunNonce", "stamp_run_nonces",
           "NONCE_TAKERS", "Failed", "run_group",
           "compute_log",
           "STALE_AFTER", "PEER_LOST_OP"]


log = logging.getLogger(__name__)

EXTENSION = "dagdiff"
#: the worker handler the scheduler calls when it removed a worker (dagdiff's scheduler
#: plugin): running programs that wait on that worker fail at once, without a probe
PEER_LOST_OP = "dagdiff_peer_lost"
#: seconds a probe's connect may take (a worker that is slow to answer is asked again)
PROBE_CONNECT_TIMEOUT = 3.0
#: finished programs whose exports this worker keeps for the next step's program on it
#: (`LocalImport`); an older one's values are read from the worker's memory instead
EXPORTS_KEPT = 2
#: seconds between looks at the worker's memory while a program waits for an import
IMPORT_POLL = 0.05
#: seconds values received for a run whose program never started here are kept (its
#: step was cancelled before it ran here); at least twice the step's timeout
STALE_AFTER = 3600.0


@dataclasses.dataclass(frozen=True)
class Failed:
    """How a run that exports values for the next step ended instead: its error's text,
    and the exception pickled (`run.cause_of`; None when it does not travel)."""

    text: str
    cause: bytes | None = None


def _note(error: BaseException, note: str) -> None:
    try:
        error.add_note(note)
    except Exception:                           # noqa: BLE001 - a frozen exception
        pass


def new_nonce() -> str:
    """A fresh id for one run of a step."""
    return uuid.uuid4().hex[:16]


class RunNonce(str):
    """A program task's run id as its graph carries it: the scheduler replaces it with a
    fresh one each time the task is submitted or run again (`stamp_run_nonces`); without
    dagdiff's scheduler plugin the id made with the graph is used."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (RunNonce, (str(self),))


#: the functions of program tasks, whose `RunNonce` the scheduler stamps (`graph` adds the
#: program task that hands back its outputs)
NONCE_TAKERS: list[Any] = []


def stamp_run_nonces(task: Any, fresh: dict[str, "RunNonce"]) -> Any:
    """`task` (a ``dask._task_spec.Task``) with each `RunNonce` among its arguments
    replaced by a fresh one, or None when it carries none. `fresh` is the table of one
    scheduler stimulus (a step's programs, or a window's, are submitted together): the
    programs of one step (`run_group`) get the same fresh id, whatever id their graph
    gave them, since the scheduler may hold on to a program task made from an earlier
    graph of the same step (its key is the same) while it makes the others from the new
    graph; each graph's own id would split the step into runs that wait for each other
    (`tests/test_direct.py`, a step submitted again while a program task lingers)."""
    args = task.args
    if not any(type(a) is RunNonce for a in args):
        return None
    group = run_group(task)
    new = tuple(fresh.setdefault(group or a, RunNonce(new_nonce())) if type(a) is RunNonce
                else a for a in args)
    return type(task)(task.key, task.func, *new, **task.kwargs)


def run_group(task: Any) -> str | None:
    """The step a program task runs (the `Program.step` of its first program: a window
    task's is its first step's), which the step's other program tasks share; None for a
    task that carries no program."""
    for a in task.args:
        if isinstance(a, Program):
            return f"step:{a.step}"
    return None


class DirectRuntime:
    """Direct dispatch on one worker (its extension ``"dagdiff"``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.transport = Transport(worker, self._deliver)
        self._lock = threading.Lock()
        self._runs: dict[str, ProgramRun] = {}
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._running: dict[str, str] = {}          # program key -> its run (cancellations)
        #: (task key, Dask run id) of program tasks released before their program began
        self._released: collections.OrderedDict[tuple[str, Any], None] = \
            collections.OrderedDict()
        #: (action key, start, stop, Dask task key, run number) of every action run here
        #: (a window's steps log under its one task and number)
        self.log: collections.deque[tuple[str, float, float, str, int]] = \
            collections.deque(maxlen=200_000)
        #: (task key, time) of every task this worker started (`dd.record`)
        self.starts: collections.deque[tuple[str, float]] = collections.deque(maxlen=200_000)
        self._runs_counter = itertools.count()
        #: per running program: its inputs and the values it holds (`runtime.memory`)
        self.held: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {}
        #: addresses of workers the scheduler removed (newest last, bounded)
        self.lost: collections.OrderedDict[str, float] = collections.OrderedDict()
        #: Dask task key -> the reporter of its programs' actions to the dashboard (one
        #: per task: a window's steps report in batches by time, not one message a step)
        self._reporters: dict[str, ActionReporter] = {}
        #: nonce -> the first failure another worker reported for a run under it: a
        #: window's steps share their nonce, and a worker ahead of the failed one (it
        #: finished that step without waiting, `ProgramRun.execute`'s ``close``) stops
        #: (its text, its exception pickled or None)
        self._failed: collections.OrderedDict[str, tuple[str, bytes | None]] = \
            collections.OrderedDict()
        #: run serial -> its exports (or its error) for the newest programs that ended
        #: here, and the condition a program waiting for one of them (`take_import`) waits on
        self._exports: collections.OrderedDict[str, dict[str, Any] | Failed] = \
            collections.OrderedDict()
        self._ended = threading.Condition(self._lock)
        #: its ends of clients' inboxes, where gathered programs push their outputs
        self.inboxes = InboxEnds(worker, WRITE_TIMEOUT)
        worker.handlers[STATUS_OP] = self._status
        worker.handlers[PEER_LOST_OP] = self._peer_lost
        worker.stream_handlers[PEER_LOST_OP] = self.peer_lost
        worker.handlers[INBOX_OP] = self.inboxes.accept
        worker.extensions[EXTENSION] = self

    # --- run states ---------------------------------------------------------------------
    def _state(self, run: str, start: bool = False) -> ProgramRun | None:
        """The state of `run` here (None once it ended). `start`: its program begins
        (raises `DirectDispatchError` if a program of this run already began here)."""
        with self._lock:
            if run in self._finished:
                return None
            st = self._runs.get(run)
            if st is None:
                st = self._runs[run] = ProgramRun(run, max(STALE_AFTER, 2 * _timeout()),
                                                   self.transport.send, self._probe)
                self._sweep(st.created)
            if start:
                if st.started:
                    raise DirectDispatchError(
                        f"a program of run {run} already started on {self.worker.address} "
                        "(an in-process worker was restarted mid-step and Dask runs the "
                        "program again). Compute the step again.")
                st.started = True
            return st

    def _sweep(self, now: float) -> None:
        """Forget runs whose program never started here in time (call with the lock)."""
        for k in [k for k, s in self._runs.items()
                  if not s.started and s.created < now - s.keep_for]:
            del self._runs[k]

    def _finish(self, run: str, outcome: str) -> None:
        with self._lock:
            self._runs.pop(run, None)
            self._finished[run] = outcome
            while len(self._finished) > 4096:
                self._finished.popitem(last=False)
            self._sweep(time.monotonic())

    async def _status(self, run: str) -> str:
        """Handler ``dagdiff_status``: what this worker knows of `run` ("running",
        "ended", "failed" or "unknown": not started here yet, or long forgotten)."""
        with self._lock:
            if run in self._finished:
                return self._finished[run]
            st = self._runs.get(run)
            return "running" if st is not None and st.started else "unknown"

    async def _peer_lost(self, address: str) -> None:
        """Handler ``dagdiff_peer_lost`` (an RPC): as `peer_lost`."""
        self.peer_lost(address)

    def peer_lost(self, address: str) -> None:
        """Stream handler ``dagdiff_peer_lost`` (dagdiff's scheduler plugin sends it on
        its stream to this worker): the scheduler removed the worker at `address`; every
        program here that waits on it stops now (the step is run again)."""
        with self._lock:
            self.lost[address] = time.monotonic()
            while len(self.lost) > 1024:
                self.lost.popitem(last=False)
            runs = list(self._runs.values())
        for st in runs:
            st.peers_lost((address,))
        self.transport.forget(address)

    # --- messages in ----------------------------------------------------------------------
    def _deliver(self, msg: Message | DecodeError) -> None:
        if isinstance(msg, DecodeError):
            run, key, why = msg.args
            msg = Failure(run, key, f"the value of {key} could not be received on "
                                    f"{self.worker.address}: {why}")
        if isinstance(msg, End) and msg.error is not None:
            self._nonce_failed(msg.run, msg.error, msg.cause)
        st = self._state(msg.run)
        if st is not None:                           # else: late, for a finished run
            st.deliver(msg)

    def _nonce_failed(self, run: str, error: str, cause: bytes | None = None) -> None:
        """A program of `run` failed elsewhere: every run here under the same nonce (the
        later steps of its window) stops, and so does one that starts later."""
        nonce = _nonce_of(run)
        with self._lock:
            if nonce in self._failed:
                return
            self._failed[nonce] = (error, cause)
            while len(self._failed) > 1024:
                self._failed.popitem(last=False)
            others = [st for r, st in self._runs.items() if r != run and _nonce_of(r) == nonce]
        for st in others:
            st.upstream_failed(error, cause)

    def cancel(self, key: str) -> None:
        """A program task was released while running (the client let go of its step):
        stop. Released before its program began (the task's thread had not got there, or
        a window's task between two of its programs), it is marked, by the task's Dask
        run id, so that its next program stops as it begins."""
        with self._lock:
            run = self._running.get(key)
            if run is None:
                self._released[(key, self._run_id(key))] = None
                while len(self._released) > 256:
                    self._released.popitem(last=False)
                return
            st = self._runs.get(run)
        if st is not None:
            st.cancel("the step was cancelled")

    def _run_id(self, key: str) -> Any:
        """The Dask run id of the task `key` executing here (None when unknown)."""
        return getattr(worker_task(self.worker, key), "run_id", None)

    def resumed(self, key: str, nonce: str) -> bool:
        """Whether the worker now runs task `key` for a newer submission than the one
        whose run id `nonce` this thread was started with. A program task released while
        its thread runs (Ctrl-C, then the same step again) and submitted again before the
        thread ended is *resumed* by distributed's worker: the thread goes on with its old
        arguments, and the new run id is only in the task's ``run_spec``; the step's
        other programs run under the new one."""
        spec = getattr(worker_task(self.worker, key), "run_spec", None)
        ids = [a for a in getattr(spec, "args", ()) if type(a) is RunNonce]
        return bool(ids) and str(ids[0]) != str(nonce)

    def close(self) -> None:
        self.transport.close()
        self.inboxes.close()

    # --- running a program ------------------------------------------------------------------
    def run(self, prog: Program, nonce: str, static_values: tuple[Any, ...],
            serial: str = "", task: str = "", secede: bool = True,
            number: int | None = None, close: bool = True) -> ProgramResult:
        """Run `prog`'s actions in order; return the values ordinary tasks read (see
        `run_program`). `serial`: this submission's name, under which its exports (or
        its error) are kept here a while for a later program's `LocalImport`. `task`:
        the Dask task running it when that is not the program's own (`run_programs`),
        whose release cancels it too, and under which its actions are logged
        (`compute_log`); `secede`: leave the thread pool first (once per task);
        `number`: the task's run number in the log (`new_number`; a fresh one when None);
        `close=False`: no closing exchange after a success (`ProgramRun.execute`)."""
        kept: dict[str, Any] | str = "it was stopped"
        try:
            exports = self._run(prog, nonce, static_values, task, secede, number, close)
            kept = exports
        except BaseException as e:
            kept = Failed(f"{type(e).__name__}: {e}", cause_of(e))
            raise
        finally:
            if serial:
                self.keep_exports(serial, kept)
        return ProgramResult(prog.key, exports)

    def keep_exports(self, serial: str, kept: dict[str, Any] | Failed) -> None:
        """Keep what run `serial` exported (or its error) for a later `LocalImport`, the
        newest `EXPORTS_KEPT` runs only, and wake the programs waiting for one."""
        with self._lock:
            self._exports[serial] = kept
            self._exports.move_to_end(serial)
            while len(self._exports) > EXPORTS_KEPT:
                self._exports.popitem(last=False)
            self._ended.notify_all()

    def new_number(self) -> int:
        """A fresh run number for the log (one per program task run here)."""
        return next(self._runs_counter)

    def _run(self, prog: Program, nonce: str, static_values: tuple[Any, ...],
             task: str = "", secede: bool = True, number: int | None = None,
             close: bool = True) -> dict[str, Any]:
        if self.worker.address != prog.address:
            raise DirectDispatchError.built_for_another(
                prog.address,
                f"{prog.key}: the step was built for {prog.where}'s worker at {prog.address}, "
                f"but runs on {self.worker.address} (the worker was lost or restarted since, "
                "and Dask runs the program again on its replacement while the other workers "
                "already went on). Compute the step again.")
        if any(self.resumed(k, nonce) for k in (prog.key, task) if k):
            # released and submitted again before this thread got here: the task runs
            # again from the scheduler, under the run id its step's programs now share
            raise Reschedule()
        run = f"{prog.step}/{nonce}"
        st = self._state(run, start=True)
        if st is None:
            raise DirectDispatchError(
                f"{prog.key} on {prog.where}: run {run} of this step already ended on this "
                "worker and Dask runs its program again alone (e.g. client.retry after a "
                "failure). Release the step's futures and compute it again (a new run).")
        with self._lock:
            self._running[prog.key] = run
            if task:
                self._running[task] = run
            released = [k for k in (prog.key, task) if k and self._released.pop(
                (k, self._run_id(k)), 0) is None]
        if released:
            self._running.pop(prog.key, None)
            self._running.pop(task, None)
            self._finish(run, "failed")
            # Dask drops the outcome of a released task; one submitted again meanwhile
            # (resumed) runs again from the scheduler, under its step's new run id
            raise Reschedule(f"{prog.key} on {prog.where}: the step was cancelled before "
                             "this program began")
        with self._lock:
            lost = [a for _, a in prog.members if a in self.lost]
            failed = self._failed.get(nonce)
        st.peers_lost(lost)
        if failed is not None:                      # an earlier step of its window
            st.upstream_failed(*failed)
        if number is None:
            number = self.new_number()
        if secede:
            _secede()
        try:
            return self._execute(prog, run, st, number, static_values, task or prog.key,
                                 close)
        finally:
            if task:
                self._running.pop(task, None)

    def take_import(self, prog: Program, st: ProgramRun, imp: LocalImport) -> Any:
        """The value `imp` names: from the exports of its program's run once that ended
        here, else from the worker's memory (an older run's value, picked by its output
        task; or the same step submitted twice, where Dask ran the other submission).
        Waits while neither has it; raises when that run failed, when this step is
        cancelled, or after the step's timeout."""
        deadline = time.monotonic() + prog.timeout
        data = self.worker.data
        while True:
            with self._lock:
                got = self._exports.get(imp.serial)
            if isinstance(got, Failed):
                what = (f"{prog.key} on {prog.where}: the step before, whose program here "
                        f"makes this step's input {imp.key}, failed")
                again = exception_of(got.cause)
                if again is not None:             # that step's own exception, once more
                    _note(again, f"dagdiff: {what} with it")
                    raise again
                raise DirectDispatchError(
                    f"{what} ({got.text[:500]}). Compute the step again from a state that "
                    "exists (trainer.fit does).")
            if got is not None and imp.export in got:
                return got[imp.export]
            try:                                  # outside the lock: it may read a spill
                return data[imp.key]
            except KeyError:
                pass
            if st.abort is not None:
                raise DirectDispatchError(f"{prog.key} on {prog.where}: {st.abort}")
            if time.monotonic() >= deadline:
                raise DirectDispatchError(
                    f"{prog.key} on {prog.where} waited {prog.timeout:g} s for its input "
                    f"{imp.key}, which the step before makes on this worker: that step never "
                    "ran here (it was released, or the worker was restarted). Compute the "
                    "step again from a state that exists.")
            with self._lock:
                if self._exports.get(imp.serial) is got:     # nothing new since the look
                    self._ended.wait(IMPORT_POLL)

    def _execute(self, prog: Program, run: str, st: ProgramRun, number: int,
                 static_values: tuple[Any, ...], task: str, close: bool = True
                 ) -> dict[str, Any]:
        statics = _Statics(zip(prog.statics, static_values),
                           lambda imp: self.take_import(prog, st, imp))
        local: dict[str, list[Any]] = {}               # key -> [value, uses left]
        self.held[prog.key] = (statics, local)         # what `runtime.memory` counts
        live = self.reporter(task) if prog.live else None

        def ran(key: str, start: float, stop: float) -> None:
            key = prog.own_key(key)
            self.log.append((key, start, stop, task, number))
            if live is not None:
                live.add(key, start, stop)

        outcome = "failed"
        try:
            exports = st.execute(prog, statics, local, ran, close)
            outcome = "ended"
        except BaseException as e:
            if st.abort is None:
                raise
            # the step was released while this ran (`cancel`): Dask drops the outcome,
            # unless the task was submitted again meanwhile and the worker resumed this
            # thread for it; then it runs again from the scheduler, under the run id the
            # step's other programs now run under, instead of failing the new step with
            # the old run's cancellation (its peers waited for it until the timeout)
            raise Reschedule(str(e)) from e
        finally:
            self.held.pop(prog.key, None)
            self._running.pop(prog.key, None)
            self._finish(run, outcome)
        return exports

    def reporter(self, task: str) -> ActionReporter:
        """The dashboard reporter of the program task `task` (made on first use)."""
        with self._lock:
            live = self._reporters.get(task)
            if live is None:
                live = self._reporters[task] = ActionReporter(self.worker, task)
            return live

    def end_task(self, task: str) -> None:
        """The program task `task` ended (or failed): report what its reporter holds."""
        with self._lock:
            live = self._reporters.pop(task, None)
        if live is not None:
            live.flush()

    def _probe(self, address: str, run: str) -> tuple[str, str]:
        """Ask the worker at `address` about `run` (from a program's thread): its state
        ("running", "ended", "failed", "unknown"), "busy" when it is slow to answer, or
        "gone" with the reason when nothing listens at the address any more."""
        fut = asyncio.run_coroutine_threadsafe(_ask_status(self.worker, address, run),
                                               self.worker.loop.asyncio_loop)
        try:
            return str(fut.result(PROBE_CONNECT_TIMEOUT + 2)), ""
        except Exception as e:                      # noqa: BLE001 - gone, or too busy
            if not _gone(e):
                fut.cancel()
                return "busy", ""                   # slow to answer: ask again later
            return "gone", _chain(e)

    # --- what ran here ------------------------------------------------------------------
    def push_output(self, spec: tuple[str, Any, tuple[Any, ...]], result: ProgramResult
                    ) -> None:
        """Push output `spec` = (key, function, arguments; `Export` arguments read from
        `result`) to the client inboxes open here, without waiting on any client; noted
        so its output task does not push it again. A failure is logged (the client then
        takes the output task's push, or gathers it)."""
        key, func, args = spec
        try:
            value = func(*(result.value(a.key) if isinstance(a, Export) else a
                           for a in args))
            self.inboxes.push_all(key, value, note=True)
        except Exception:                           # noqa: BLE001 - the output task pushes
            log.exception("dagdiff: the program's push of %s failed", key)

    def compute_log(self, keys: Any = None) -> dict[str, Any]:
        """What ran on this worker, in the scheduler's clock (one offset for all, so their
        order on a worker is exactly the order they ran in): ``"programs"``: per program
        task key (a window's: every step's), one list per run (oldest first) of (action
        key, start, stop) of its actions;
        ``"starts"``: per task key, when each of its runs began executing (oldest first)."""
        want = None if keys is None else set(keys)
        delay = scheduler_delay(self.worker)
        runs: dict[str, dict[int, list[tuple[str, float, float]]]] = {}
        for k, a, b, pk, n in list(self.log):
            if want is None or pk in want:
                runs.setdefault(pk, {}).setdefault(n, []).append((k, a + delay, b + delay))
        programs = {pk: [by_run[n] for n in sorted(by_run)] for pk, by_run in runs.items()}
        starts: dict[str, list[float]] = {}
        for k, t in list(self.starts):
            if want is None or k in want:
                starts.setdefault(k, []).append(t + delay)
        return {"programs": programs, "starts": starts}

    def started(self, key: str) -> None:
        """A task began executing here (called by dagdiff's worker plugin). The task stream
        shifts each task's times by the worker's clock offset of that moment, which moves
        with every heartbeat; these local times keep a worker's order exact."""
        self.starts.append((key, now()))


async def _ask_status(worker: Any, address: str, run: str) -> str:
    """Ask the worker at `address` about `run` (over its own comm, short deadline)."""
    comm = await connect(address, timeout=PROBE_CONNECT_TIMEOUT, name="dagdiff-probe",
                         **worker.connection_args)
    try:
        await comm.write({"op": STATUS_OP, "run": run, "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _chain(e: BaseException | None) -> str:
    """An exception and its causes, as one line."""
    parts = []
    while e is not None and len(parts) < 4:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "; ".join(parts)


def _gone(e: BaseException) -> bool:
    """Whether a failed probe says nothing listens at the address any more (refused, no
    such in-process endpoint), rather than that the worker is slow to answer."""
    text = _chain(e).lower()
    return "refused" in text or "no endpoint" in text or "unreachable" in text


def install(worker: Any) -> DirectRuntime:
    """The worker's runtime, installed once (worker plugin setup, ``--preload dagdiff``)."""
    rt = getattr(worker, "extensions", {}).get(EXTENSION)
    if rt is None:
        rt = DirectRuntime(worker)
    return rt


def runtime() -> DirectRuntime:
    """The runtime of the worker running the current task."""
    return install(get_worker())


class _Statics(dict):  # type: ignore[type-arg]
    """A program's inputs from outside it; a `LocalImport` among them is taken when an
    action first reads it (inside the interpreter, so a failure reaches the other
    programs of the run like any action's)."""

    def __init__(self, items: Any, take: Any) -> None:
        super().__init__(items)
        self._take = take

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        if isinstance(value, LocalImport):
            value = self._take(value)
            dict.__setitem__(self, key, value)
        return value


def run_program(prog: Program, nonce: str, /, *static_values: Any, serial: str = "",
                push: tuple[str, Any, tuple[Any, ...]] | None = None) -> ProgramResult:
    """A program task: run a worker's actions in order; return the values ordinary
    tasks read (a `ProgramResult`: a stub when sent to another worker).

    Each action waits for its inputs (same-worker values are at hand; other workers'
    values arrive by message), runs, and hands its value on: kept here until its last
    local use, queued for each other worker that reads it. The first failure stops the
    program; the consumers of its remaining actions on other workers get the error at
    once, and the task fails with it. A program returns only when every program of its
    run succeeded (the closing exchange).

    `push`: (key, function, arguments) of an output its result gives alone (a Trainer
    step's loss: `graph.push_output`), pushed to the client inboxes open here as soon as
    the run succeeded, before the output's own task (which waits for the other programs'
    results) runs."""
    rt = runtime()
    try:
        result = rt.run(prog, nonce, static_values, serial)
        if push is not None:
            rt.push_output(push, result)
        return result
    finally:
        rt.end_task(prog.key)


def run_programs(task: str, n: int, nonce: str, /, *rest: Any,
                 keep: tuple[str, ...] = ()) -> ProgramResult:
    """A window of `n` steps' programs on one worker, as one task (`task`): each step's
    program runs after the one before, as its own run of its step (`nonce` with the
    step's token names it, so their messages never mix), reading the state the one before
    exported (`LocalImport`). `rest` holds, per step, (program, serial, the number of its
    inputs, its inputs...). Returns the exports `keep` of all of them (what the window's
    outputs read: every step's loss parts, the last step's state). Only the last step's
    program makes the closing exchange: an earlier one goes on to the next step as soon
    as its own actions are done, not waiting for the slowest worker (~8% of a tiny step).
    The first failure stops the window: the steps after it do not run, and the task fails
    with it; a worker already further on hears of it by the window's nonce and stops."""
    rt, wanted = runtime(), set(keep)
    out: dict[str, Any] = {}
    at = 0
    number = rt.new_number()
    try:
        for i in range(n):
            prog, serial, count = rest[at], rest[at + 1], rest[at + 2]
            args = tuple(rest[at + 3:at + 3 + count])
            at += 3 + count
            result = rt.run(prog, nonce, args, serial, task=task, secede=i == 0,
                            number=number, close=i == n - 1)
            out.update((f"{i}:{k}", v) for k, v in result.items() if f"{i}:{k}" in wanted)
    finally:
        rt.end_task(task)
    return ProgramResult(task, out)


NONCE_TAKERS.extend((run_program, run_programs))


def _nonce_of(run: str) -> str:
    """The nonce of a run id (``<step token>/<nonce>``)."""
    return run.rpartition("/")[2]


def compute_log(keys: Any = None, dask_worker: Any = None) -> dict[str, Any]:
    """`DirectRuntime.compute_log` of a worker (run through `Client.run`)."""
    rt = getattr(dask_worker, "extensions", {}).get(EXTENSION)
    return rt.compute_log(keys) if rt is not None else {"programs": {}, "starts": {}}


def _secede() -> None:
    """Leave the worker's thread pool: the worker goes on with its other tasks (the next
    step's program, other work) while this program waits for its inputs."""
    try:
        secede()
    except Exception:                        # noqa: BLE001 - not inside a worker task
        pass


def _timeout() -> float:
    return float(parse_timedelta(dask.config.get("dagdiff.direct.timeout", "600s")))
