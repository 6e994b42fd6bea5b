"""One run of a step's program on one worker: its inbox, its interpreter, its waits and its
outbox, in a `ProgramRun` that owns them (distributed's shuffle ``ShuffleRun`` is the model).

A run knows nothing of Dask: the worker's `DirectRuntime` routes messages to it by run id,
and hands it two callables, one that queues a message for an address and one that asks a
worker about a run (a probe). Everything a run's waits read (values received, errors, end
marks, a cancellation, lost peers, failed sends) lives under its one condition.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable

from distributed.metrics import time as now

from ...errors import DirectDispatchError, UpstreamError
from .messages import End, Failure, Message, Value, pack
from .plan import PlannedAction
from .program import Program


__all__ = ["ProgramRun", "Send", "Probe", "PROBE_AFTER", "PROBE_EVERY", "CAUSE_BYTES",
           "cause_of", "exception_of"]

#: seconds an input may be awaited before its producer's worker is asked about the run,
#: and between asks: a lost worker fails the step in seconds, not after the timeout
PROBE_AFTER = 2.0
PROBE_EVERY = 2.0

#: queue a message for an address; the callback gets None, or the error of the write
Send = Callable[[str, Message, Callable[[BaseException | None], None]], None]
#: ask the worker at an address about a run: ("running" | "ended" | "failed" | "unknown" |
#: "busy", "") or ("gone", why): nothing listens there any more
Probe = Callable[[str, str], tuple[str, str]]


class ProgramRun:
    """One run's state on this worker (created by the first message or by its program's
    start, whichever comes first), and the run of its program."""

    def __init__(self, run: str, keep_for: float, send: Send, probe: Probe) -> None:
        self.run = run
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
        self.causes: dict[str, bytes] = {}          # an error's text -> its exception
        self.created = time.monotonic()
        self.started = False
        self.keep_for = keep_for
        self._send_to = send
        self._probe = probe

    # --- what reaches the run -------------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        """A message of another program of this run."""
        with self.cond:
            if isinstance(msg, Value):
                self.values[msg.key] = [msg.value, msg.uses]
                self.cond.notify_all()
                return
            if msg.error is not None and msg.cause is not None:
                self.causes.setdefault(msg.error, msg.cause)
            if isinstance(msg, Failure):
                self.errors[msg.key] = msg.error
            else:
                self.ends[msg.sender] = msg.error
                if msg.error is not None and self.failed is None:
                    self.failed = msg.error
            self.cond.notify_all()

    def cancel(self, why: str) -> None:
        """Stop the program (its step was released while running)."""
        with self.cond:
            if self.abort is None:
                self.abort = why
            self.cond.notify_all()

    def upstream_failed(self, error: str, cause: bytes | None = None) -> None:
        """Another program of this run's window failed (in an earlier step of the window,
        which this worker already finished): stop at the next action, with its error."""
        with self.cond:
            if cause is not None:
                self.causes.setdefault(error, cause)
            if self.failed is None:
                self.failed = error
            self.cond.notify_all()

    def peers_lost(self, addresses: Any) -> None:
        """The scheduler removed these workers: a wait on any of them stops now."""
        with self.cond:
            self.lost.update(addresses)
            self.cond.notify_all()

    # --- running the program --------------------------------------------------------------
    def execute(self, prog: Program, statics: dict[str, Any], local: dict[str, list[Any]],
                ran: Callable[[str, float, float], None], close: bool = True
                ) -> dict[str, Any]:
        """Run `prog`'s actions in order and the closing exchange; return the exported
        values, or raise the first failure (after telling the other programs).
        `local` holds same-worker values until their last use; `ran(key, start, stop)` is
        told of each action that ran. `close=False` (a window's step before its last):
        a success returns at once, without the closing exchange, whose wait for the
        slowest program would hold up the next step; the window's last step closes for
        all of them (a program reaches it only when its earlier steps succeeded), and a
        failure is still told to every other program, which stops the window there too
        (`DirectRuntime`: failures by nonce)."""
        exports: dict[str, Any] = {}
        failure: BaseException | None = None
        for a in prog.actions:
            if failure is None:
                try:
                    values = {k: (_take_local(local, k) if src == prog.where
                                  else self._take_remote(prog, a, k, src))
                              for k, src in a.inputs}
                    self._check(prog, a)
                    values.update((d, statics[d]) for d in a.task.dependencies
                                  if d not in values)
                    t0 = now()
                    out = a.task(values)
                    t1 = now()
                    del values
                    ran(a.key, t0, t1)
                    if a.local:
                        local[a.key] = [out, a.local]
                    if a.export:
                        exports[a.key] = out
                    self._post(a, out)
                    del out
                    continue
                except BaseException as e:
                    failure = e
                    local.clear()
            self._send_error(prog, a, failure)
        if failure is None and not close:
            return exports
        failure = self._close(prog, failure)
        if failure is not None:
            raise failure
        return exports

    def _check(self, prog: Program, a: PlannedAction) -> None:
        """Raise if the step was cancelled, failed elsewhere (no need to wait for the rest
        of it), could not send one of this program's values, or lost a worker."""
        if self.abort is not None:
            raise DirectDispatchError(f"{a.key} on {prog.where}: {self.abort}")
        if self.failed is not None:
            raise self.upstream(self.failed)
        if self.send_errors:
            raise self._send_failure(prog)
        if self.lost:
            for where, address in prog.members:
                if address in self.lost:
                    raise DirectDispatchError(
                        f"{a.key} on {prog.where}: the scheduler removed {where}'s worker at "
                        f"{address}, which runs part of this step (the worker was lost or "
                        "restarted mid-step). Compute the step again (trainer.fit and "
                        "step.compute(retries=) do, on the live workers).")

    # --- waiting ----------------------------------------------------------------------------
    def _await(self, prog: Program, a: PlannedAction, ready: Callable[[], bool], src: str,
               what: str, on_timeout: str, on_state: Callable[[str, str], None]) -> None:
        """Wait (holding the condition) until `ready()`; raise on a cancellation, a failure
        elsewhere, a lost worker or the deadline; while waiting, probe `src`'s worker now
        and then and let `on_state(state, why)` judge its answer (it raises to stop)."""
        start = time.monotonic()
        deadline = start + prog.timeout
        next_probe = start + PROBE_AFTER
        while not ready():
            self._check(prog, a)
            t = time.monotonic()
            if t >= deadline:
                raise DirectDispatchError(on_timeout)
            if t >= next_probe:
                self.cond.release()
                try:
                    state, why = self._probe(prog.address_of(src), self.run)
                finally:
                    self.cond.acquire()
                if ready():
                    break
                on_state(state, why)
                next_probe = time.monotonic() + PROBE_EVERY
                continue
            self.cond.wait(min(deadline - t, next_probe - t, 1.0))

    def _take_remote(self, prog: Program, a: PlannedAction, key: str, src: str) -> Any:
        """An input from another worker: its message (or its error)."""

        def on_state(state: str, why: str) -> None:
            if state == "gone":
                raise DirectDispatchError(
                    f"{a.key} on {prog.where} waits for input {key} from {src} at "
                    f"{prog.address_of(src)}, where nothing listens any more ({why}): the "
                    "worker was lost or restarted mid-step. Compute the step again; "
                    "dispatch='scheduler' recomputes lost work instead.")
            if state in ("ended", "failed"):
                # its program is over, and it could not have ended before this program's
                # end mark without sending the value: Dask ran this program again alone
                # (e.g. on a restarted worker)
                raise DirectDispatchError(
                    f"{a.key} on {prog.where} waits for input {key} from {src} at "
                    f"{prog.address_of(src)}, whose program of this run already "
                    f"{state} without sending it. Compute the step again.")

        with self.cond:
            self._await(
                prog, a, lambda: key in self.values or key in self.errors, src,
                f"input {key}",
                f"{a.key} on {prog.where} waited {prog.timeout:g} s for input {key} from "
                f"{src}: a worker was lost or restarted mid-step, or an upstream task hangs. "
                "Compute the step again; raise dask config 'dagdiff.direct.timeout' if "
                "tasks legitimately take longer; dispatch='scheduler' recomputes lost work.",
                on_state)
            if key in self.errors:
                raise self.upstream(self.errors[key])
            value = self.values[key]
            value[1] -= 1
            if value[1] <= 0:
                del self.values[key]
            return value[0]

    def _take_end(self, prog: Program, a: PlannedAction, where: str) -> None:
        """`where`'s end mark (raises the error it carries)."""

        def on_state(state: str, why: str) -> None:
            if state == "gone":
                raise DirectDispatchError(
                    f"{prog.key} on {prog.where}: {where} at {prog.address_of(where)} went "
                    "away before it told how its part of the step ended (the worker was "
                    "lost or restarted mid-step). Compute the step again.")
            # "ended"/"failed": its end mark was written before, and is on its way

        with self.cond:
            self._await(
                prog, a, lambda: where in self.ends, where, "the end of its program",
                f"{prog.key} on {prog.where} waited {prog.timeout:g} s for {where} to "
                "finish its part of the step: a worker was lost or an action hangs. "
                "Compute the step again.", on_state)
            if self.ends[where] is not None:
                raise self.upstream(self.ends[where])

    def upstream(self, error: str) -> BaseException:
        """What this program raises for a failure elsewhere in the step (`error`, as the
        failing program told it): the failing program's own exception where it came
        along (a copy: a layer's ValueError is a ValueError on every worker of the step,
        whichever of them Dask reports first), else an `UpstreamError` naming it."""
        return exception_of(self.causes.get(error)) or UpstreamError(error)

    # --- messages out -----------------------------------------------------------------------
    def _send(self, target: tuple[str, str], msg: Message, counted: bool) -> None:
        """Queue `msg` for the worker `target` = (where, address). `counted`: failures
        count as the run's send errors and `_flush` waits for it; otherwise failures are
        ignored (best effort: a failed program does not wait)."""
        where, address = target
        what = f"{getattr(msg, 'key', 'end')} to {where} at {address}"
        if counted:
            with self.cond:
                self.pending += 1

        def done(error: BaseException | None) -> None:
            with self.cond:
                if counted:
                    self.pending -= 1
                if error is not None:
                    self.gone.add(where)
                    if counted:
                        self.send_errors.append(f"{what} ({type(error).__name__}: {error})")
                self.cond.notify_all()

        self._send_to(address, msg, done)

    def _post(self, a: PlannedAction, value: Any) -> None:
        """Queue the value (only the leaves each worker reads) for its consumers on other
        workers; the event loop writes it while the program goes on."""
        for r in a.remote:
            self._send((r.where, r.address),
                       Value(self.run, a.key, r.uses, pack(value, r.leaves)), counted=True)

    def _send_error(self, prog: Program, a: PlannedAction, error: BaseException) -> None:
        """Tell the remote consumers of an action that will not run why (best effort;
        none after a cancellation, which stops every program of the step)."""
        if self.abort is not None:
            return
        text = _describe(error, f"{a.key} failed on {prog.where}")
        cause = cause_of(error)
        for r in a.remote:
            if r.where not in self.gone:
                self._send((r.where, r.address), Failure(self.run, a.key, text, cause),
                           counted=False)

    def _flush(self, prog: Program) -> BaseException | None:
        """Wait until every value this program queued was written (or failed)."""
        deadline = time.monotonic() + prog.timeout
        with self.cond:
            while self.pending > 0 and not self.send_errors:
                if self.abort is not None:
                    return DirectDispatchError(f"{prog.key} on {prog.where}: {self.abort}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return DirectDispatchError(
                        f"{prog.key} on {prog.where}: {self.pending} value(s) still not "
                        f"sent after {prog.timeout:g} s; is a consumer's worker stuck?")
                self.cond.wait(min(left, 1.0))
            if self.send_errors:
                return self._send_failure(prog)
        return None

    def _close(self, prog: Program, failure: BaseException | None) -> BaseException | None:
        """The run's closing exchange: tell every other program of the run how this one
        ended, then (if it succeeded) wait until each of them says how it ended. A program
        returns only when the whole run succeeded, so what its outputs hand on (e.g. new
        parameters to the next step) never outlives a failure elsewhere in the step.

        The marks are queued behind this program's values (so they arrive after them),
        to all peers at once; a failed program does not wait for them to be written."""
        if failure is None:
            failure = self._flush(prog)
        if not prog.members:
            return failure
        if failure is not None:
            text = _describe(failure, f"the step failed on {prog.where}")
            cause = cause_of(failure)
            for target in prog.members:
                if target[0] not in self.gone:
                    self._send(target, End(self.run, prog.where, text, cause),
                               counted=False)
            return failure
        for target in prog.members:
            self._send(target, End(self.run, prog.where), counted=True)
        end = PlannedAction(f"{prog.key} (closing exchange)", (), 0, (), False)
        try:
            for where, _ in prog.members:
                self._take_end(prog, end, where)
        except BaseException as e:
            return e
        failure = self._flush(prog)                # our marks were written, too
        if failure is not None:
            return DirectDispatchError(
                f"{prog.key} could not tell every other worker of the step that it finished "
                f"({failure}): a worker was lost or restarted mid-step")
        return None

    def _send_failure(self, prog: Program) -> DirectDispatchError:
        return DirectDispatchError(
            f"{prog.where} could not send {'; '.join(self.send_errors[:3])}: the worker was "
            "lost or restarted mid-step. Compute the step again, or use "
            "dispatch='scheduler'.")


def _take_local(local: dict[str, list[Any]], key: str) -> Any:
    """A same-worker input (always there: the order came from a valid run); dropped
    after its last use."""
    value = local[key]
    value[1] -= 1
    if value[1] <= 0:
        del local[key]
    return value[0]


def _describe(error: BaseException, what: str) -> str:
    """An error as other programs read it: upstream and dispatch errors as they are
    (they already name the first failure), and so a failure elsewhere raised here again
    (`ProgramRun.upstream`); others prefixed with where they happened."""
    if isinstance(error, (UpstreamError, DirectDispatchError)) or \
            getattr(error, "_dagdiff_cause", None) is not None:
        return str(error)
    return f"{what}: {type(error).__name__}: {error}"


#: the largest pickled exception a failure message carries (larger: its text only)
CAUSE_BYTES = 64 * 1024


def cause_of(error: BaseException) -> bytes | None:
    """`error` pickled for the other programs of the step to raise (`Failure.cause`), or
    None: dagdiff's dispatch errors (a lost worker, a cancellation, a timeout: each
    program says where it stands itself), an exception that does not pickle or that
    pickles to more than `CAUSE_BYTES`."""
    cause = getattr(error, "_dagdiff_cause", None)
    if cause is not None:
        return cause
    if isinstance(error, (UpstreamError, DirectDispatchError)) or \
            not isinstance(error, Exception):
        return None
    try:
        cause = pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(cause)                     # it must come back, too
    except Exception:                           # noqa: BLE001 - the text goes alone
        return None
    return cause if len(cause) <= CAUSE_BYTES else None


def exception_of(cause: bytes | None) -> BaseException | None:
    """A fresh copy of the exception `cause_of` pickled (it carries its cause on, for
    the programs it fails in turn), or None."""
    if cause is None:
        return None
    try:
        e = pickle.loads(cause)
    except Exception:                           # noqa: BLE001 - the caller's text then
        return None
    if not isinstance(e, BaseException):
        return None
    try:
        e._dagdiff_cause = cause                # type: ignore[attr-defined]
    except AttributeError:                      # no __dict__: passed on as text
        pass
    return e

