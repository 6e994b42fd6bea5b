"""The direct-dispatch runtime of one worker: runs programs and keeps each run's state.

A `DirectRuntime` is a worker extension (``worker.extensions["dagdiff"]``), installed by
dagdiff's worker plugin or ``--preload dagdiff``. It owns the worker's `Transport` and
the state of every run of a program on this worker: values and errors received from the
run's other programs, what this program still sends, and why a run was stopped.

A *run* is one execution of a step's programs. Its id is the step's token plus the
nonce its programs read (a tiny task of the step, computed once per submission of the
step's graph): computing a step again runs its programs again under a new nonce, so
the runs never mix, even when Dask reuses every key.

Why ~600 lines in one module: the interpreter, its waits (with probes of a silent
producer's worker), the outbox and the closing exchange all work on one run's state
under its one lock; split apart they would pass that state and lock around. Turning
`_Run` into a run object that owns this behaviour (distributed's shuffle `ShuffleRun`
is the model) is the planned next step (issue #28).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed import get_worker, secede
from distributed.comm import connect
from distributed.metrics import time as now

from ...errors import DirectDispatchError, UpstreamError
from ..internals import scheduler_delay
from ..live import ActionReporter
from ..taskspec import Task
from .messages import End, Failure, Message, Value, pack
from .program import Action, Program
from .results import ProgramResult
from .transport import STATUS_OP, DecodeError, Transport


__all__ = ["EXTENSION", "DirectRuntime", "install", "runtime",
           "run_program", "new_nonce", "compute_log", "PROBE_AFTER", "PROBE_EVERY",
           "STALE_AFTER", "PEER_LOST_OP"]

log = logging.getLogger(__name__)

EXTENSION = "dagdiff"
#: the worker handler the scheduler calls when it removed a worker (dagdiff's scheduler
#: plugin): running programs that wait on that worker fail at once, without a probe
PEER_LOST_OP = "dagdiff_peer_lost"
#: seconds an input may be awaited before its producer's worker is asked about the run,
#: and between asks: a lost worker fails the step in seconds, not after the timeout
PROBE_AFTER = 2.0
PROBE_EVERY = 2.0
#: seconds a probe's connect may take (a worker that is slow to answer is asked again)
PROBE_CONNECT_TIMEOUT = 3.0
#: seconds values received for a run whose program never started here are kept (its
#: step was cancelled before it ran here); at least twice the step's timeout
STALE_AFTER = 3600.0


class _Run:
    """One run's state on this worker."""

    def __init__(self, keep_for: float) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.values: dict[str, list[Any]] = {}      # key -> [value, uses left]
        self.errors: dict[str, str] = {}
        self.ends: dict[str, str | None] = {}       # sender -> its error (None: success)
        self.abort: str | None = None               # cancelled
        self.failed: str | None = None              # another program of the run failed
        self.pending = 0                            # messages of ours still being written
        self.send_errors: list[str] = []
        self.gone: set[str] = set()                 # workers a message could not reach
        self.lost: set[str] = set()                 # addresses the scheduler removed
        self.created = time.monotonic()
        self.started = False
        self.keep_for = keep_for


def new_nonce() -> str:
    """A fresh id for one run of a step (the value of the step's ``run_`` task)."""
    return uuid.uuid4().hex[:16]


class DirectRuntime:
    """Direct dispatch on one worker (its extension ``"dagdiff"``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.transport = Transport(worker, self._deliver)
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._running: dict[str, str] = {}          # program key -> its run (cancellations)
        #: (action key, start, stop, program key, run number) of every action run here
        self.log: collections.deque[tuple[str, float, float, str, int]] = \
            collections.deque(maxlen=200_000)
        #: (task key, time) of every task this worker started (`dd.record`)
        self.starts: collections.deque[tuple[str, float]] = collections.deque(maxlen=200_000)
        self._runs_counter = itertools.count()
        #: per running program: its inputs and the values it holds (`runtime.memory`)
        self.held: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {}
        #: addresses of workers the scheduler removed (newest last, bounded)
        self.lost: collections.OrderedDict[str, float] = collections.OrderedDict()
        worker.handlers[STATUS_OP] = self._status
        worker.handlers[PEER_LOST_OP] = self._peer_lost
        worker.extensions[EXTENSION] = self

    # --- run states ---------------------------------------------------------------------
    def _state(self, run: str, start: bool = False) -> _Run | None:
        """The state of `run` here (None once it ended). `start`: its program begins
        (raises `DirectDispatchError` if a program of this run already began here)."""
        with self._lock:
            if run in self._finished:
                return None
            st = self._runs.get(run)
            if st is None:
                st = self._runs[run] = _Run(max(STALE_AFTER, 2 * _timeout()))
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
        """Handler ``dagdiff_peer_lost``: the scheduler removed the worker at `address`;
        every program here that waits on it stops now (the step is run again)."""
        with self._lock:
            self.lost[address] = time.monotonic()
            while len(self.lost) > 1024:
                self.lost.popitem(last=False)
            runs = list(self._runs.values())
        for st in runs:
            with st.cond:
                st.lost.add(address)
                st.cond.notify_all()

    # --- messages in ----------------------------------------------------------------------
    def _deliver(self, msg: Message | DecodeError) -> None:
        if isinstance(msg, DecodeError):
            run, key, why = msg.args
            msg = Failure(run, key, f"the value of {key} could not be received on "
                                    f"{self.worker.address}: {why}")
        st = self._state(msg.run)
        if st is None:
            return                                   # a late message for a finished run
        with st.cond:
            if isinstance(msg, Value):
                st.values[msg.key] = [msg.value, msg.uses]
            elif isinstance(msg, Failure):
                st.errors[msg.key] = msg.error
            else:
                st.ends[msg.sender] = msg.error
                if msg.error is not None and st.failed is None:
                    st.failed = msg.error
            st.cond.notify_all()

    def cancel(self, key: str) -> None:
        """A program was released while running (the client let go of its step): stop."""
        run = self._running.get(key)
        if run is None:
            return
        with self._lock:
            st = self._runs.get(run)
        if st is None:
            return
        with st.cond:
            if st.abort is None:
                st.abort = "the step was cancelled"
            st.cond.notify_all()

    def close(self) -> None:
        self.transport.close()

    # --- running a program ------------------------------------------------------------------
    def run(self, prog: Program, nonce: str, static_values: tuple[Any, ...]) -> ProgramResult:
        """Run `prog`'s actions in order; return the values ordinary tasks read (see
        `run_program`)."""
        if self.worker.address != prog.address:
            raise DirectDispatchError(
                f"{prog.key}: the step was built for {prog.where}'s worker at {prog.address}, "
                f"but runs on {self.worker.address} (the worker was lost or restarted since, "
                "and Dask runs the program again on its replacement while the other workers "
                "already went on). Compute the step again.")
        run = f"{prog.step}/{nonce}"
        st = self._state(run, start=True)
        if st is None:
            raise DirectDispatchError(
                f"{prog.key} on {prog.where}: run {run} of this step already ended on this "
                "worker and Dask runs its program again alone (e.g. client.retry after a "
                "failure). Release the step's futures and compute it again (a new run).")
        self._running[prog.key] = run
        with self._lock:
            st.lost.update(a for _, a in prog.members if a in self.lost)
        number = next(self._runs_counter)
        _secede()
        statics = dict(zip(prog.statics, static_values))
        local: dict[str, list[Any]] = {}               # key -> [value, uses left]
        self.held[prog.key] = (statics, local)         # what `runtime.memory` counts
        exports: dict[str, Any] = {}
        failure: BaseException | None = None
        live = ActionReporter(self.worker, prog.key) if prog.live else None
        try:
            for a in prog.actions:
                if failure is None:
                    try:
                        values = {k: (_take_local(local, k) if src == prog.where
                                      else self._take_remote(st, prog, run, a, k, src))
                                  for k, src in a.inputs}
                        _check(st, prog, a)
                        values.update((d, statics[d]) for d in a.task.dependencies
                                      if d not in values)
                        t0 = now()
                        out = a.task(values)
                        t1 = now()
                        del values
                        self.log.append((a.key, t0, t1, prog.key, number))
                        if live is not None:
                            live.add(a.key, t0, t1)
                        if a.local:
                            local[a.key] = [out, a.local]
                        if a.export:
                            exports[a.key] = out
                        self._post(st, prog, run, a, out)
                        del out
                        continue
                    except BaseException as e:
                        failure = e
                        local.clear()
                self._send_error(st, prog, run, a, failure)
            failure = self._close(st, prog, run, failure)
        finally:
            if live is not None:
                live.flush()
            self.held.pop(prog.key, None)
            self._running.pop(prog.key, None)
            self._finish(run, "ended" if failure is None else "failed")
        if failure is not None:
            raise failure
        return ProgramResult(prog.key, exports)

    def _take_remote(self, st: _Run, prog: Program, run: str, a: Action, key: str,
                     src: str) -> Any:
        """An input from another worker: wait for its message (or an error, an abort, the
        deadline); while waiting, ask the producing worker now and then about the run."""
        start = time.monotonic()
        deadline = start + prog.timeout
        next_probe = start + PROBE_AFTER
        with st.cond:
            while key not in st.values and key not in st.errors:
                _check(st, prog, a)
                t = time.monotonic()
                left = deadline - t
                if left <= 0:
                    raise DirectDispatchError(
                        f"{a.key} on {prog.where} waited {prog.timeout:g} s for input {key} "
                        f"from {src}: a worker was lost or restarted mid-step, or an upstream "
                        "task hangs. Compute the step again; raise dask config "
                        "'dagdiff.direct.timeout' if tasks legitimately take longer; "
                        "dispatch='scheduler' recomputes lost work.")
                if t >= next_probe:
                    st.cond.release()
                    try:
                        state = self._probe(prog, run, a, f"input {key}", src)
                    finally:
                        st.cond.acquire()
                    if state in ("ended", "failed") and key not in st.values \
                            and key not in st.errors:
                        # its program is over, and it could not have ended before this
                        # program's end mark without sending the value: Dask ran this
                        # program again alone (e.g. on a restarted worker)
                        raise DirectDispatchError(
                            f"{a.key} on {prog.where} waits for input {key} from {src} at "
                            f"{prog.address_of(src)}, whose program of this run already "
                            f"{state} without sending it. Compute the step again.")
                    next_probe = time.monotonic() + PROBE_EVERY
                    continue
                st.cond.wait(min(left, next_probe - t, 1.0))
            if key in st.errors:
                raise UpstreamError(st.errors[key])
            value = st.values[key]
            value[1] -= 1
            if value[1] <= 0:
                del st.values[key]
            return value[0]

    def _probe(self, prog: Program, run: str, a: Action, what: str, src: str) -> str:
        """Ask the worker that produces `what` about this run: its state ("running",
        "ended", "failed", "unknown"), or "busy" when it is slow to answer; raise if
        nothing listens at its address any more (the worker was lost)."""
        address = prog.address_of(src)
        fut = asyncio.run_coroutine_threadsafe(_ask_status(self.worker, address, run),
                                               self.worker.loop.asyncio_loop)
        try:
            return str(fut.result(PROBE_CONNECT_TIMEOUT + 2))
        except Exception as e:                      # noqa: BLE001 - gone, or too busy
            if not _gone(e):
                fut.cancel()
                return "busy"                       # slow to answer: ask again later
            raise DirectDispatchError(
                f"{a.key} on {prog.where} waits for {what} from {src} at {address}, "
                f"where nothing listens any more ({_chain(e)}): the worker was lost or "
                "restarted mid-step. Compute the step again; dispatch='scheduler' "
                "recomputes lost work instead.") from None

    # --- messages out -----------------------------------------------------------------------
    def _send(self, st: _Run, run: str, target: tuple[str, str], msg: Message,
              counted: bool) -> None:
        """Queue `msg` for the worker `target` = (where, address). `counted`: failures
        count as the run's send errors and `_flush` waits for it; otherwise failures are
        logged (best effort: a failed program does not wait)."""
        where, address = target
        what = f"{getattr(msg, 'key', 'end')} to {where} at {address}"
        if counted:
            with st.cond:
                st.pending += 1

        def done(error: BaseException | None) -> None:
            with st.cond:
                if counted:
                    st.pending -= 1
                if error is not None:
                    st.gone.add(where)
                    if counted:
                        st.send_errors.append(f"{what} ({type(error).__name__}: {error})")
                    else:                   # the transport logs the peer's failure
                        log.debug("dagdiff: could not send %s (%s: %s)", what,
                                  type(error).__name__, error)
                st.cond.notify_all()

        self.transport.send(address, msg, done)

    def _post(self, st: _Run, prog: Program, run: str, a: Action, value: Any) -> None:
        """Queue the value (only the leaves each worker reads) for its consumers on other
        workers; the event loop writes it while this program goes on."""
        for r in a.remote:
            self._send(st, run, (r.where, r.address),
                       Value(run, a.key, r.uses, pack(value, r.leaves)), counted=True)

    def _send_error(self, st: _Run, prog: Program, run: str, a: Action,
                    error: BaseException) -> None:
        """Tell the remote consumers of an action that will not run why (best effort;
        none after a cancellation, which stops every program of the step)."""
        if st.abort is not None:
            return
        text = _describe(error, f"{a.key} failed on {prog.where}")
        for r in a.remote:
            if r.where not in st.gone:
                self._send(st, run, (r.where, r.address), Failure(run, a.key, text),
                           counted=False)

    def _flush(self, st: _Run, prog: Program) -> BaseException | None:
        """Wait until every value this program queued was written (or failed)."""
        deadline = time.monotonic() + prog.timeout
        with st.cond:
            while st.pending > 0 and not st.send_errors:
                if st.abort is not None:
                    return DirectDispatchError(f"{prog.key} on {prog.where}: {st.abort}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return DirectDispatchError(
                        f"{prog.key} on {prog.where}: {st.pending} value(s) still not sent "
                        f"after {prog.timeout:g} s; is a consumer's worker stuck?")
                st.cond.wait(min(left, 1.0))
            if st.send_errors:
                return _send_failure(prog, st)
        return None

    def _close(self, st: _Run, prog: Program, run: str,
               failure: BaseException | None) -> BaseException | None:
        """The run's closing exchange: tell every other program of the run how this one
        ended, then (if it succeeded) wait until each of them says how it ended. A program
        returns only when the whole run succeeded, so what its outputs hand on (e.g. new
        parameters to the next step) never outlives a failure elsewhere in the step.

        The marks are queued behind this program's values (so they arrive after them),
        to all peers at once; a failed program does not wait for them to be written."""
        if failure is None:
            failure = self._flush(st, prog)
        if not prog.members:
            return failure
        if failure is not None:
            text = _describe(failure, f"the step failed on {prog.where}")
            for target in prog.members:
                if target[0] not in st.gone:
                    self._send(st, run, target, End(run, prog.where, text), counted=False)
            return failure
        for target in prog.members:
            self._send(st, run, target, End(run, prog.where), counted=True)
        end = Action(f"{prog.key} (closing exchange)", Task(prog.key + "-end", _noop),
                     (), 0, (), False)
        try:
            for where, _ in prog.members:
                self._take_end(st, prog, run, end, where)
        except BaseException as e:
            return e
        failure = self._flush(st, prog)            # our marks were written, too
        if failure is not None:
            return DirectDispatchError(
                f"{prog.key} could not tell every other worker of the step that it finished "
                f"({failure}): a worker was lost or restarted mid-step")
        return None

    def _take_end(self, st: _Run, prog: Program, run: str, a: Action, where: str) -> None:
        """Wait for `where`'s end mark (probing it like any input)."""
        deadline = time.monotonic() + prog.timeout
        next_probe = time.monotonic() + PROBE_AFTER
        with st.cond:
            while where not in st.ends:
                _check(st, prog, a)
                t = time.monotonic()
                if t >= deadline:
                    raise DirectDispatchError(
                        f"{prog.key} on {prog.where} waited {prog.timeout:g} s for {where} "
                        "to finish its part of the step: a worker was lost or an action "
                        "hangs. Compute the step again.")
                if t >= next_probe:
                    st.cond.release()
                    try:
                        state = self._probe(prog, run, a, "the end of its program", where)
                    except DirectDispatchError:
                        state = "gone"
                    finally:
                        st.cond.acquire()
                    if where in st.ends:
                        break
                    if state == "gone":
                        raise DirectDispatchError(
                            f"{prog.key} on {prog.where}: {where} at "
                            f"{prog.address_of(where)} went away before it told how its "
                            "part of the step ended (the worker was lost or restarted "
                            "mid-step). Compute the step again.")
                    # "ended"/"failed": its end mark was written before, and is on its way
                    next_probe = time.monotonic() + PROBE_EVERY
                    continue
                st.cond.wait(min(deadline - t, next_probe - t, 1.0))
            if st.ends[where] is not None:
                raise UpstreamError(st.ends[where])

    # --- what ran here ------------------------------------------------------------------
    def compute_log(self, keys: Any = None) -> dict[str, Any]:
        """What ran on this worker, in the scheduler's clock (one offset for all, so their
        order on a worker is exactly the order they ran in): ``"programs"``: per program
        key, one list per run (oldest first) of (action key, start, stop) of its actions;
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


def run_program(prog: Program, nonce: str, /, *static_values: Any) -> ProgramResult:
    """A program task: run a worker's actions in order; return the values ordinary
    tasks read (a `ProgramResult`: a stub when sent to another worker).

    Each action waits for its inputs (same-worker values are at hand; other workers'
    values arrive by message), runs, and hands its value on: kept here until its last
    local use, queued for each other worker that reads it. The first failure stops the
    program; the consumers of its remaining actions on other workers get the error at
    once, and the task fails with it. A program returns only when every program of its
    run succeeded (the closing exchange)."""
    return runtime().run(prog, nonce, static_values)


def compute_log(keys: Any = None, dask_worker: Any = None) -> dict[str, Any]:
    """`DirectRuntime.compute_log` of a worker (run through `Client.run`)."""
    rt = getattr(dask_worker, "extensions", {}).get(EXTENSION)
    return rt.compute_log(keys) if rt is not None else {"programs": {}, "starts": {}}


def _check(st: _Run, prog: Program, a: Action) -> None:
    """Raise if the step was cancelled, failed elsewhere (no need to wait for the rest
    of it), or could not send one of this program's values."""
    if st.abort is not None:
        raise DirectDispatchError(f"{a.key} on {prog.where}: {st.abort}")
    if st.failed is not None:
        raise UpstreamError(st.failed)
    if st.send_errors:
        raise _send_failure(prog, st)
    if st.lost:
        for where, address in prog.members:
            if address in st.lost:
                raise DirectDispatchError(
                    f"{a.key} on {prog.where}: the scheduler removed {where}'s worker at "
                    f"{address}, which runs part of this step (the worker was lost or "
                    "restarted mid-step). Compute the step again (trainer.fit and "
                    "step.compute(retries=) do, on the live workers).")


def _take_local(local: dict[str, list[Any]], key: str) -> Any:
    """A same-worker input (always there: the order came from a valid run); dropped
    after its last use."""
    value = local[key]
    value[1] -= 1
    if value[1] <= 0:
        del local[key]
    return value[0]


def _send_failure(prog: Program, st: _Run) -> DirectDispatchError:
    return DirectDispatchError(
        f"{prog.where} could not send {'; '.join(st.send_errors[:3])}: the worker was "
        "lost or restarted mid-step. Compute the step again, or use dispatch='scheduler'.")


def _describe(error: BaseException, what: str) -> str:
    """An error as other programs read it: upstream and dispatch errors as they are
    (they already name the first failure), others prefixed with where they happened."""
    if isinstance(error, (UpstreamError, DirectDispatchError)):
        return str(error)
    return f"{what}: {type(error).__name__}: {error}"


def _noop() -> None:
    return None


def _secede() -> None:
    """Leave the worker's thread pool: the worker goes on with its other tasks (the next
    step's program, other work) while this program waits for its inputs."""
    try:
        secede()
    except Exception:                        # noqa: BLE001 - not inside a worker task
        pass


def _timeout() -> float:
    return float(parse_timedelta(dask.config.get("dagdiff.direct.timeout", "600s")))
