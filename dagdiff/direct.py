"""Direct dispatch: each worker runs its part of a pipeline step as one task (its
*program*), in schedule order, and sends activations and cotangents straight to the
worker that consumes them, so no action waits for the scheduler.

On distributed every dependent hop costs a scheduler round trip plus a transfer (5-10 ms
measured on a small machine), which is as long as a pipeline action itself, and every
task costs the scheduler and its worker some bookkeeping (about a millisecond of CPU on
a small machine, spent while the pipeline runs). Here the graph is rewritten before
submission (`rewrite`): the step's tasks that live on a worker become the *actions* of
that worker's program,

* in the order of a simulated run of the schedule: the schedule's actions in order, the
  small tasks (microbatch slices, sums, accumulators) where their inputs first exist
  (`linearize`, which also rejects a schedule that would deadlock);
* reading same-worker values in process (each value dropped after its last use, so a
  forward's pullback lives exactly as long as the schedule says) and other workers'
  values from one direct message each (`dagdiff.channel`).

A program depends only on the step's inputs (parameters, batch), so a step is a handful
of Dask tasks per worker: the program, one small task per value an ordinary task reads
(the step's outputs), and a ``done`` task; every output waits for every worker's
``done``, so a failure anywhere reaches the caller and no program is culled while an
output is wanted. Failures travel downstream as error messages, cancelled steps wake
their program, and every wait has a deadline (``dagdiff.direct.timeout``, default
600 s): nothing waits forever. `dd.record` reads each action's compute interval from
its worker, so timelines show actions, not programs.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import uuid
import weakref
from typing import Any, Collection, Mapping

from dask._task_spec import DataNode, Task, TaskRef

from .errors import DagdiffError, PlacementError
from .keys import make_key, sanitize
from .tasks import leaves_read

__all__ = [
    "DirectDispatchError",
    "UpstreamError",
    "Action",
    "Program",
    "DirectPlan",
    "rewrite",
    "linearize",
    "run_program",
    "install_handlers",
    "endpoint",
    "endpoints",
    "compute_log",
    "started",
    "RESOURCE_SHARE",
]

log = logging.getLogger(__name__)

#: share of a slot resource one program holds: a program leaves the thread pool
#: (``secede``) but keeps its resources, so whole units would block the worker's next
#: task, e.g. the next step's program (2**-20: exact in binary)
RESOURCE_SHARE = 2.0 ** -20
_COUNTER = itertools.count(1)


class DirectDispatchError(DagdiffError, RuntimeError):
    """A direct-dispatch step could not go on: an input never came (a worker was lost or
    the step was cancelled), or the schedule would deadlock."""


class UpstreamError(DagdiffError, RuntimeError):
    """An input of this task failed on its own worker (the message names the first failure)."""


# --- build time: rewrite the graph ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Remote:
    """Consumers of a value on another worker."""

    where: str                    # the worker's slot (or address)
    address: str                  # its Dask address
    endpoint: Any                 # its `dagdiff.channel` endpoint
    uses: int                     # consumer actions there
    leaves: frozenset[int] | None = None   # the leaves they read (None: all)


@dataclasses.dataclass(frozen=True)
class Action:
    """One task of a program: the original Dask task (ordering-only edges dropped), where
    its inputs come from, and where its value goes."""

    key: str
    task: Task
    inputs: tuple[tuple[str, str], ...]   # (producer key, producer's worker), other actions
    local: int                            # consumer actions on this worker
    remote: tuple[Remote, ...]            # consumers on other workers
    export: bool                          # an ordinary task (an output) reads it from Dask


@dataclasses.dataclass(frozen=True)
class Program:
    """A worker's part of one step: its actions in run order."""

    key: str
    step: str                             # id shared by the step's programs
    where: str                            # worker slot (or address), for messages
    actions: tuple[Action, ...]
    statics: tuple[str, ...]              # Dask keys the actions read (params, batch)
    timeout: float
    #: where -> (address, channel endpoint) of each worker this program reads from, to
    #: notice a producer that died instead of waiting for the timeout
    peers: tuple[tuple[str, str, Any], ...] = ()
    #: the channel endpoint of the worker process the program was built for
    endpoint: Any = None
    #: (where, address, endpoint) of the step's other programs, for the closing exchange
    members: tuple[tuple[str, str, Any], ...] = ()

    def peer(self, where: str) -> tuple[str, Any]:
        for w, address, ep in self.peers + self.members:
            if w == where:
                return address, ep
        return where, None


@dataclasses.dataclass
class DirectPlan:
    """The rewritten graph: tasks, the order per worker, priorities and placement of
    the new tasks (programs, their outputs, completion tasks)."""

    dsk: dict[str, Any]
    order: dict[str, list[str]]        # worker -> action keys in run order
    priority: dict[str, int]
    placed: dict[str, str]             # new task -> its worker (programs, outputs, done)


def rewrite(dsk: Mapping[str, Any], worker_of: Mapping[str, str | None],
            priority: Mapping[str, int], keep: set[str], addresses: Mapping[str, str],
            token: str, slots: bool = True,
            timeout: float | None = None,
            endpoints: Mapping[str, Any] | None = None,
            outputs: Collection[str] = ()) -> DirectPlan:
    """Turn every task that has a worker (and is not in `keep`, the step's outputs that
    stay ordinary tasks, and does not wait on an ordinary task) into an action of its
    worker's program.

    `keep` outputs wait for every program of the step (so computing any of them runs
    the whole step). `outputs` are keys the caller reads straight from their program
    (e.g. a Trainer's new parameters, read by the next step on the same worker): they
    cost no cross-worker Dask edge, and the programs' closing exchange (`run_program`)
    makes each of them fail when any program of the step fails.

    `worker_of`: key -> slot name (or address when `slots` is False); `priority`: the
    schedule's priorities (higher runs earlier on its worker; keys without one are small
    tasks placed where their inputs are ready); `addresses`: slot -> worker address;
    `endpoints`: worker address -> its `dagdiff.channel` endpoint."""
    if timeout is None:
        timeout = _timeout()
    dsk = dict(dsk)
    deps_of = {k: _deps(t) if isinstance(t, Task) else [] for k, t in dsk.items()}
    direct: set[str] = set()
    for key in _topological({k: _Deps(v) for k, v in deps_of.items()}):
        if not isinstance(dsk[key], Task) or key in keep or worker_of.get(key) is None:
            continue
        if all(d in direct or d not in dsk or isinstance(dsk[d], DataNode)
               for d in deps_of[key]):
            direct.add(key)
    if not direct:
        return DirectPlan(dsk, {}, {}, {})
    inbox = {k: [d for d in deps_of[k] if d in direct] for k in direct}
    missing = sorted({w for k in direct if (w := worker_of[k]) not in addresses})
    if missing and slots:
        raise PlacementError(f"direct dispatch: no worker address for {', '.join(missing)}; "
                             "is every slot's worker running?")
    addr = (lambda w: addresses[w]) if slots else (lambda w: w)

    def ep(w: str) -> Any:                   # a worker's channel endpoint (None: none)
        return (endpoints or {}).get(addr(w))

    readers: dict[str, list[str]] = collections.defaultdict(list)
    for k, ds in inbox.items():
        for d in ds:
            readers[d].append(k)
    exports = {d for k, t in dsk.items() if k not in direct and isinstance(t, Task)
               for d in t.dependencies if d in direct} | (set(outputs) & direct)
    reads = {k: leaves_read(dsk[k]) for k in direct}
    order = linearize(inbox, {k: worker_of[k] for k in direct},
                      {k: priority[k] for k in direct if k in priority})
    step = f"{token}-{uuid.uuid4().hex[:12]}"
    base = -10_000_000 * next(_COUNTER)      # later steps rank below earlier ones on every worker
    out_priority: dict[str, int] = {}
    placed: dict[str, str] = {}
    done_refs: list[TaskRef] = []
    for i, w in enumerate(sorted(order)):
        actions = []
        statics: set[str] = set()
        for k in order[w]:
            t = dsk.pop(k)
            by_worker = collections.Counter(worker_of[c] for c in readers.get(k, ()))
            local = by_worker.pop(w, 0)
            remote = tuple(Remote(ww, addr(ww), ep(ww), n,
                                  _leaves(k, [c for c in readers[k] if worker_of[c] == ww],
                                          reads))
                           for ww, n in sorted(by_worker.items()))
            kwargs = {n: v for n, v in t.kwargs.items() if not _ordering_only(n, v, direct)}
            statics.update(d for d in deps_of[k] if d not in direct)
            actions.append(Action(k, Task(k, t.func, *t.args, **kwargs),
                                  tuple((d, worker_of[d]) for d in inbox[k]), local, remote,
                                  k in exports))
        pk = make_key("program", sanitize(w), i, token)
        srcs = sorted({src for a in actions for _, src in a.inputs if src != w})
        peers = tuple((src, addr(src), ep(src)) for src in srcs)
        members = tuple((ww, addr(ww), ep(ww)) for ww in sorted(order) if ww != w)
        prog = Program(pk, step, w, tuple(actions), tuple(sorted(statics)), timeout, peers,
                       ep(w), members)
        dsk[pk] = Task(pk, run_program, prog, *[TaskRef(s) for s in prog.statics])
        placed[pk] = w
        out_priority[pk] = base
        for a in actions:
            if a.export:           # the value an output reads, as an ordinary result
                dsk[a.key] = Task(a.key, _pick, TaskRef(pk), a.key)
                placed[a.key] = w
        # completion on the program's worker (nothing moves); every output waits for all
        dk = make_key("done", "step", i, token)
        dsk[dk] = Task(dk, _done, TaskRef(pk))
        placed[dk] = w
        done_refs.append(TaskRef(dk))
    for k, t in list(dsk.items()):
        if k in keep and isinstance(t, Task):
            dsk[k] = Task(k, _after, len(done_refs), *done_refs, t.func, *t.args, **t.kwargs)
    return DirectPlan(dsk, order, out_priority, placed)


def _leaves(key: str, consumers: list[str],
            reads: Mapping[str, Mapping[str, frozenset[int] | None]]) -> frozenset[int] | None:
    """The leaves of `key`'s value that `consumers` read (None: the whole value)."""
    out: set[int] = set()
    for c in consumers:
        got = reads[c].get(key)
        if got is None:
            return None
        out |= got
    return frozenset(out)


def _ordering_only(name: str, value: Any, direct: set[str]) -> bool:
    """`after_<i>` keyword arguments are the scheduler-mode ordering edges; actions
    run in their program's order instead."""
    return name.startswith("after_") and isinstance(value, TaskRef) and value.key in direct


def _deps(t: Task) -> list[str]:
    """Data dependencies of a task (ordering-only `after_` edges left out)."""
    skip = {v.key for n, v in t.kwargs.items()
            if n.startswith("after_") and isinstance(v, TaskRef)}
    return sorted(set(t.dependencies) - skip)


def _topological(dsk: Mapping[str, Any]) -> list[str]:
    indeg = {k: 0 for k in dsk}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for k, t in dsk.items():
        for d in getattr(t, "dependencies", ()):
            if d in dsk:
                indeg[k] += 1
                users[d].append(k)
    ready = collections.deque(k for k, n in indeg.items() if n == 0)
    out = []
    while ready:
        k = ready.popleft()
        out.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(out) < len(indeg):
        stuck = sorted(k for k, n in indeg.items() if n)[:4]
        raise DirectDispatchError(f"the task graph has a cycle through {', '.join(stuck)}")
    return out


def linearize(deps: Mapping[str, list[str]], worker_of: Mapping[str, str],
              priority: Mapping[str, int]) -> dict[str, list[str]]:
    """Per worker, the order its tasks run in: tasks with a priority (schedule actions)
    in decreasing priority, the others as soon as their inputs exist in a simulated run
    of the schedule (one action per worker per round). Orders taken from one valid
    sequential run cannot deadlock; a schedule that cannot run raises here, at build
    time, naming what each worker waits for."""
    users: dict[str, list[str]] = collections.defaultdict(list)
    missing = {k: 0 for k in deps}
    for k, ds in deps.items():
        for d in ds:
            users[d].append(k)
            missing[k] += 1
    topo = {k: i for i, k in enumerate(_topological({k: _Deps(v) for k, v in deps.items()}))}
    queues: dict[str, collections.deque[str]] = {}
    for w in sorted(set(worker_of.values())):
        acts = sorted((k for k in deps if worker_of[k] == w and k in priority),
                      key=lambda k: (-priority[k], topo[k]))
        queues[w] = collections.deque(acts)
    order: dict[str, list[str]] = {w: [] for w in queues}
    # small tasks without inputs (microbatch slices) go right before their first
    # consumer, so a worker's first action waits for one of them, not for all
    lazy = {k for k in deps if k not in priority and not missing[k] and users.get(k)}
    for k in lazy:
        for u in users[k]:
            missing[u] -= 1
    free = collections.deque(sorted((k for k in deps if k not in priority and not missing[k]
                                     and k not in lazy), key=topo.__getitem__))
    placed = 0

    def place(k: str) -> None:
        nonlocal placed
        for d in deps[k]:
            if d in lazy:            # its consumers no longer count it as missing
                lazy.discard(d)
                order[worker_of[d]].append(d)
                placed += 1
        order[worker_of[k]].append(k)
        placed += 1
        for u in users.get(k, ()):
            missing[u] -= 1
            if not missing[u] and u not in priority:
                free.append(u)

    def drain() -> None:
        while free:
            place(free.popleft())

    drain()
    while placed < len(deps):
        progressed = False
        for w, q in queues.items():
            if q and not missing[q[0]]:
                place(q.popleft())
                drain()
                progressed = True
        if not progressed:
            stuck = []
            for w, q in queues.items():
                if q:
                    waits = [d for d in deps[q[0]] if d not in set(order[worker_of[d]])]
                    stuck.append(f"{w} at {q[0]} (waits for {', '.join(waits[:3])})")
            raise DirectDispatchError(
                "the schedule cannot run: every worker waits for a task that comes later "
                f"in another worker's order: {'; '.join(stuck) or 'no action left'}. Check "
                "the Schedule's actions (each F needs the previous stage's F of that "
                "microbatch, each B the next stage's B).")
    return order


class _Deps:
    """Adapter so `_topological` reads a dependency list like a Task."""

    __slots__ = ("dependencies",)

    def __init__(self, deps: list[str]) -> None:
        self.dependencies = deps


def _timeout() -> float:
    import dask
    from dask.utils import parse_timedelta

    return float(parse_timedelta(dask.config.get("dagdiff.direct.timeout", "600s")))


def _done(exports: Any) -> None:
    """Completion of a step on one worker (its input: the worker's program)."""
    return None


def _pick(exports: dict[str, Any], key: str) -> Any:
    """The value of action `key`, from its program's exports."""
    return exports[key]


def _after(n: int, *rest: Any, **kwargs: Any) -> Any:
    """An output task that also waits for the step's `n` completion tasks."""
    func, args = rest[n], rest[n + 1:]
    return func(*args, **kwargs)


# --- run time: the worker side ----------------------------------------------------------

class _Step:
    """One step's state on one worker: values and errors received from other workers,
    and why the step was aborted (if it was)."""

    def __init__(self) -> None:
        import time as _time

        self.cond = threading.Condition(threading.Lock())
        self.values: dict[str, list[Any]] = {}      # key -> [value, uses left]
        self.errors: dict[str, str] = {}
        self.abort: str | None = None
        self.failed: str | None = None              # another program of the step failed
        self.pending = 0                            # values of ours still being sent
        self.send_errors: list[str] = []            # values of ours that could not be
        self.created = _time.monotonic()
        self.started = False
        self.keep_for = STALE_AFTER                 # seconds kept if its program never starts
        self.gone: set[str] = set()                 # workers a message could not reach


# state per (step, worker): several workers may share a process (processes=False)
_STEPS: dict[tuple[str, str], _Step] = {}
_FINISHED: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
_RUNNING: dict[str, tuple[str, str]] = {}           # program key -> its step (cancellations)
_GLOBAL = threading.Lock()
#: (action key, start, stop, program key, run number) of every action run in this process
_LOG: collections.deque[tuple[str, float, float, str, int]] = collections.deque(maxlen=200_000)
_RUNS = itertools.count()
#: (task key, time) of every task this process's workers started (`started`)
_STARTS: collections.deque[tuple[str, float]] = collections.deque(maxlen=200_000)


def started(key: str) -> None:
    """A task began executing here (called by dagdiff's worker plugin). The task stream
    shifts each task's times by the worker's clock offset of that moment, which moves
    with every heartbeat; these local times keep a worker's order exact."""
    from distributed.metrics import time

    _STARTS.append((key, time()))


#: seconds after which values received for a program that never started are dropped
#: (its step was cancelled before it ran here); at least twice the step's timeout
STALE_AFTER = 3600.0


class _AlreadyStarted(Exception):
    pass


def _step(step: tuple[str, str], start: bool = False, timeout: float = 0.0) -> _Step | None:
    """The state of `step` on this worker (None once it ended here). `start`: the program
    begins (raises `_AlreadyStarted` if a program of this step already began here)."""
    with _GLOBAL:
        if step in _FINISHED:
            return None
        st = _STEPS.get(step)
        if st is None:
            st = _STEPS[step] = _Step()
            _sweep(st.created)
        st.keep_for = max(st.keep_for, 2 * timeout)
        if start:
            if st.started:
                raise _AlreadyStarted
            st.started = True
        return st


def _sweep(now: float) -> None:
    """Forget steps whose program never started here in time (call with _GLOBAL held)."""
    for k in [k for k, s in _STEPS.items() if not s.started and s.created < now - s.keep_for]:
        del _STEPS[k]


def _finish(step: tuple[str, str]) -> None:
    import time as _time

    with _GLOBAL:
        _STEPS.pop(step, None)
        _FINISHED[step] = None
        while len(_FINISHED) > 1024:
            _FINISHED.popitem(last=False)
        _sweep(_time.monotonic())


def run_program(prog: Program, /, *static_values: Any) -> dict[str, Any]:
    """Run a worker's actions in order; return the values ordinary tasks read.

    Each action waits for its inputs (same-worker values are at hand; other workers'
    values arrive by message), runs, and hands its value on: kept here until its last
    local use, queued for each other worker that reads it. The first failure stops the
    program; the consumers of its remaining actions on other workers get the error at
    once, and the task fails with it. A program returns only when every program of its
    step succeeded (the closing exchange, `_close`)."""
    from distributed.metrics import time

    here = (prog.step, prog.where)
    if prog.endpoint is not None:
        from .channel import endpoint as own

        if own() != prog.endpoint:
            raise DirectDispatchError(
                f"{prog.key}: the step was built for {prog.where}'s worker process, which "
                "was lost or restarted since (Dask runs the program again on its "
                "replacement, but the other workers already went on). Run the step again.")
    try:
        st = _step(here, start=True, timeout=prog.timeout)
    except _AlreadyStarted:
        raise DirectDispatchError(
            f"{prog.key} on {prog.where}: a run of this program already started in this "
            "process (an in-process worker was restarted mid-step and Dask runs the program "
            "again). Run the step again.") from None
    if st is None:
        raise DirectDispatchError(
            f"{prog.key} on {prog.where}: this step already ended on this worker (it "
            "finished, failed or was cancelled) and Dask runs its program again, e.g. "
            "after a worker was lost mid-step. Run the step again.")
    _RUNNING[prog.key] = here
    run = next(_RUNS)
    _secede()
    statics = dict(zip(prog.statics, static_values))
    local: dict[str, list[Any]] = {}                  # key -> [value, uses left]
    exports: dict[str, Any] = {}
    failure: BaseException | None = None
    try:
        for a in prog.actions:
            if failure is None:
                try:
                    values = {k: (_take_local(local, k) if src == prog.where
                                  else _take_remote(st, prog, a, k, src))
                              for k, src in a.inputs}
                    _check(st, prog, a)
                    values.update((d, statics[d]) for d in a.task.dependencies
                                  if d not in values)
                    t0 = time()
                    out = a.task(values)
                    t1 = time()
                    del values
                    _LOG.append((a.key, t0, t1, prog.key, run))
                    if a.local:
                        local[a.key] = [out, a.local]
                    if a.export:
                        exports[a.key] = out
                    _post(st, prog, a, out)
                    del out
                    continue
                except BaseException as e:
                    failure = e
                    local.clear()
            _send_error(st, prog, a, failure)
        failure = _close(st, prog, failure)
    finally:
        _RUNNING.pop(prog.key, None)
        _finish(here)
    if failure is not None:
        raise failure
    return exports


def _close(st: _Step, prog: Program, failure: BaseException | None) -> BaseException | None:
    """The step's closing exchange: tell every other program of the step how this one
    ended, then (if it succeeded) wait until each of them says how it ended. A program
    returns only when the whole step succeeded, so what its outputs hand on (e.g. new
    parameters to the next step) never outlives a failure elsewhere in the step.

    The marks are queued behind this program's values (so they arrive after them) and
    written by each peer's sender thread, all peers at once; a failed program does not
    wait for them to be written."""
    if failure is None:
        failure = _flush(st, prog)
    if not prog.members:
        return failure
    mark = f"{_END}{prog.where}"
    if failure is not None:
        _mark(st, prog, mark, [(w, a, ep, 1) for w, a, ep in prog.members],
              _describe(failure, f"the step failed on {prog.where}"), wait=False)
        return failure
    _mark(st, prog, mark, [(w, a, ep, 1) for w, a, ep in prog.members], None, wait=True)
    end = Action(f"{prog.key} (closing exchange)", Task(mark, _done, None), (), 0, (), False)
    try:
        for where, _, _ in prog.members:
            _take_remote(st, prog, end, f"{_END}{where}", where)
    except BaseException as e:
        return e
    failure = _flush(st, prog)                # our marks were written, too
    if failure is not None:
        return DirectDispatchError(
            f"{prog.key} could not tell every other worker of the step that it finished "
            f"({failure}): a worker was lost or restarted mid-step")
    return None


_END = "__end__/"


def _check(st: _Step, prog: Program, a: Action) -> None:
    """Raise if the step was cancelled, failed elsewhere (no need to wait for the rest
    of it), or could not send one of this program's values."""
    if st.abort is not None:
        raise DirectDispatchError(f"{a.key} on {prog.where}: {st.abort}")
    if st.failed is not None:
        raise UpstreamError(st.failed)
    if st.send_errors:
        raise _send_failure(prog, st)


def _take_local(local: dict[str, list[Any]], key: str) -> Any:
    """A same-worker input (always there: the order came from a valid run); dropped
    after its last use."""
    value = local[key]
    value[1] -= 1
    if value[1] <= 0:
        del local[key]
    return value[0]


def _take_remote(st: _Step, prog: Program, a: Action, key: str, src: str) -> Any:
    """An input from another worker: wait for its message (or an error, an abort, the
    deadline); while waiting, check now and then that the producing worker still runs."""
    import time as _time

    start = _time.monotonic()
    deadline = start + prog.timeout
    next_probe = start + PROBE_AFTER
    with st.cond:
        while key not in st.values and key not in st.errors:
            _check(st, prog, a)
            now = _time.monotonic()
            left = deadline - now
            if left <= 0:
                raise DirectDispatchError(
                    f"{a.key} on {prog.where} waited {prog.timeout:g} s for input {key} "
                    f"from {src}: a worker was lost or restarted mid-step, or an upstream "
                    "task hangs. Run the step again; raise dask config "
                    "'dagdiff.direct.timeout' if tasks legitimately take longer; "
                    "dispatch='scheduler' recomputes lost work.")
            if now >= next_probe:
                st.cond.release()
                try:
                    _probe(prog, a, key, src)
                finally:
                    st.cond.acquire()
                next_probe = _time.monotonic() + PROBE_EVERY
                continue
            st.cond.wait(min(left, next_probe - now, 1.0))
        if key in st.errors:
            raise UpstreamError(st.errors[key])
        value = st.values[key]
        value[1] -= 1
        if value[1] <= 0:
            del st.values[key]
        return value[0]


#: seconds an input may be awaited before its producer's worker is checked, and between
#: checks: a lost worker fails the step in seconds, not after the timeout
PROBE_AFTER = 2.0
PROBE_EVERY = 2.0


def _probe(prog: Program, a: Action, key: str, src: str) -> None:
    """Raise if the worker that produces `key` no longer listens (its process ended)."""
    address, ep = prog.peer(src)
    if ep is None:
        return
    from .channel import reachable

    if reachable(ep) is False:               # refused: nothing listens there any more
        raise DirectDispatchError(
            f"{a.key} on {prog.where} waits for input {key} from {src} at {address}, which "
            "no longer runs (the worker was lost or restarted mid-step). Run the step "
            "again; dispatch='scheduler' recomputes lost work instead.")


def _secede() -> None:
    """Leave the worker's thread pool: the worker goes on with its other tasks (the next
    step's program, other work) while this program waits for its inputs."""
    from distributed import secede

    try:
        secede()
    except Exception:                        # not inside a worker task (tests, threads)
        pass


def _mark(st: _Step, prog: Program, key: str, targets: Any, error: str | None,
          wait: bool) -> None:
    """Queue a message without a value (an error, or a program's end) about `key` for
    each (where, address, endpoint, uses) in `targets` that was reachable so far. With
    `wait`, failures count as the step's send errors and `_flush` waits for them;
    without, they are logged (best effort: a failed program does not wait)."""
    from .channel import post

    for where, address, ep, uses in targets:
        if where in st.gone or ep is None:
            continue
        msg = {"step": prog.step, "where": where, "key": key, "uses": uses,
               "error": error, "value": None, "timeout": prog.timeout}
        if wait:
            with st.cond:
                st.pending += 1
        post(ep, msg, functools.partial(_sent, st, f"{key} to {where} at {address}", where,
                                        wait))


def _sent(st: _Step, what: str, where: str, counted: bool,
          error: BaseException | None) -> None:
    """A queued message was written (error None) or could not be."""
    with st.cond:
        if counted:
            st.pending -= 1
        if error is not None:
            st.gone.add(where)
            if counted:
                st.send_errors.append(f"{what} ({type(error).__name__}: {error})")
            else:
                log.warning("dagdiff: could not send %s (%s: %s)", what,
                            type(error).__name__, error)
        st.cond.notify_all()


def _describe(error: BaseException, what: str) -> str:
    """An error as other programs read it: upstream and dispatch errors as they are
    (they already name the first failure), others prefixed with where they happened."""
    if isinstance(error, (UpstreamError, DirectDispatchError)):
        return str(error)
    return f"{what}: {type(error).__name__}: {error}"


def _post(st: _Step, prog: Program, a: Action, value: Any) -> None:
    """Queue the value (only the leaves each worker reads) for the consumers on other
    workers: each peer's sender thread converts, pickles and writes it while this
    program goes on; failures are collected on the step (`_send_failure`)."""
    if not a.remote:
        return
    from .channel import post

    for r in a.remote:
        what = f"{a.key} to {r.where} at {r.address}"
        if r.endpoint is None:
            with st.cond:
                st.send_errors.append(f"{what} (no dagdiff channel there)")
            continue

        def message(r: Remote = r) -> dict[str, Any]:
            return {"step": prog.step, "where": r.where, "key": a.key, "uses": r.uses,
                    "error": None, "value": _wire(value, r.leaves), "timeout": prog.timeout}

        with st.cond:
            st.pending += 1
        post(r.endpoint, message, functools.partial(_sent, st, what, r.where, True))


def _send_failure(prog: Program, st: _Step) -> DirectDispatchError:
    return DirectDispatchError(
        f"{prog.where} could not send {'; '.join(st.send_errors[:3])}: the worker was "
        "lost or restarted mid-step, or does not run dagdiff (start workers with "
        "--preload dagdiff). Run the step again, or use dispatch='scheduler'.")


def _flush(st: _Step, prog: Program) -> BaseException | None:
    """Wait until every value this program queued was written (or failed)."""
    import time as _time

    deadline = _time.monotonic() + prog.timeout
    with st.cond:
        while st.pending > 0 and not st.send_errors:
            if st.abort is not None:
                return DirectDispatchError(f"{prog.key} on {prog.where}: {st.abort}")
            left = deadline - _time.monotonic()
            if left <= 0:
                return DirectDispatchError(
                    f"{prog.key} on {prog.where}: {st.pending} value(s) still not sent "
                    f"after {prog.timeout:g} s; is a consumer's worker stuck?")
            st.cond.wait(min(left, 1.0))
        if st.send_errors:
            return _send_failure(prog, st)
    return None


def _send_error(st: _Step, prog: Program, a: Action, error: BaseException) -> None:
    """Tell the remote consumers of an action that will not run why (queued, best effort:
    a consumer that cannot be reached times out instead; none after a cancellation,
    which stops every program of the step)."""
    if st.abort is None:
        _mark(st, prog, a.key, [(r.where, r.address, r.endpoint, r.uses) for r in a.remote],
              _describe(error, f"{a.key} failed on {prog.where}"), wait=False)


def _wire(value: Any, leaves: frozenset[int] | None = None) -> Any:
    """What another worker receives: forward results without their pullback, only the
    `leaves` it reads of a tuple or forward result (the others None, so indices hold),
    and jax arrays as NumPy arrays (pickled without JAX's reconstruction cost; the
    consumer's jitted function puts them on its device)."""
    import jax
    import numpy as np

    from .tasks import FwdResult

    def host(x: Any) -> Any:
        return np.asarray(x) if isinstance(x, jax.Array) else x

    def keep(i: int) -> bool:
        return leaves is None or i in leaves

    if isinstance(value, FwdResult):
        return FwdResult([host(x) if keep(i) else None for i, x in enumerate(value.out)],
                         None, moved=True,
                         res=jax.tree_util.tree_map(host, value.res) if leaves is None else None)
    if isinstance(value, (tuple, list)):
        return type(value)(_wire(v) if keep(i) else None for i, v in enumerate(value))
    return host(value)


def _deliver(msg: dict[str, Any]) -> None:
    """A value (or error) for consumers of `msg['key']` on worker `msg['where']`."""
    st = _step((msg["step"], msg["where"]), timeout=float(msg.get("timeout") or 0.0))
    if st is None:
        return                                   # a late message for a finished step
    with st.cond:
        if msg.get("error") is None:
            st.values[msg["key"]] = [msg["value"], msg["uses"]]
        else:
            st.errors[msg["key"]] = msg["error"]
            if msg["key"].startswith(_END) and st.failed is None:
                st.failed = msg["error"]
        st.cond.notify_all()


def _abort(step: tuple[str, str], reason: str) -> None:
    """Wake the program of `step` on this worker with `reason` (it stops before its next
    action), and forget the step (late messages for it are dropped)."""
    with _GLOBAL:
        st = _STEPS.get(step)
    if st is None:
        return
    with st.cond:
        if st.abort is None:
            st.abort = reason
        st.cond.notify_all()
    _finish(step)


def cancelled(key: str) -> None:
    """A program was cancelled while running (the client released the step): abort it."""
    step = _RUNNING.get(key)
    if step is not None:
        _abort(step, "the step was cancelled")


def install_handlers(worker: Any) -> None:
    """Start this worker process's channel listener (TCP workers only; on other
    transports pipelines use dispatch='scheduler')."""
    address = getattr(worker, "address", "") or ""
    if address.startswith("tcp://"):
        from distributed.comm import get_address_host

        from .channel import start

        try:
            worker._dagdiff_channel = start(get_address_host(address), _deliver)
        except OSError as e:
            log.warning("dagdiff: no direct channel on %s (%s); pipelines will use "
                        "dispatch='scheduler'", address, e)


_ENDPOINTS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, Any], tuple[Any, float]]]" = \
    weakref.WeakKeyDictionary()
#: seconds before a worker that had no channel is asked again
ASK_AGAIN_AFTER = 30.0


def endpoints(client: Any, addresses: set[str]) -> dict[str, Any]:
    """Channel endpoint per worker address, asked through `Client.run` once per worker
    process (keyed by the worker's id, so a worker restarted at the same address is asked
    again); None for a worker without one (asked again after `ASK_AGAIN_AFTER`)."""
    if client is None or not addresses:
        return {}
    import time as _time

    from .cluster import latest_workers_info

    ids = {a: (w or {}).get("id") for a, w in latest_workers_info(client).items()}
    cache = _ENDPOINTS.setdefault(client, {})
    now = _time.monotonic()

    def known(a: str) -> bool:
        got = cache.get((a, ids.get(a)))
        return got is not None and (got[0] is not None or now - got[1] < ASK_AGAIN_AFTER)

    missing = sorted(a for a in addresses if not known(a))
    if missing:
        try:
            answers = client.run(endpoint, workers=missing)
        except Exception as e:
            log.warning("dagdiff: could not ask workers for direct channels (%s)", e)
            answers = {}
        for a in missing:
            cache[(a, ids.get(a))] = (answers.get(a), now)
    return {a: cache[(a, ids.get(a))][0] for a in addresses}


def endpoint(dask_worker: Any = None) -> Any:
    """This worker's channel endpoint, or None (run on workers through `Client.run`)."""
    return getattr(dask_worker, "_dagdiff_channel", None)


def compute_log(keys: Any = None, dask_worker: Any = None) -> dict[str, Any]:
    """What ran in this process, in the scheduler's clock (shifted with one offset for
    all, so their order on a worker is exactly the order they ran in):

    * ``"programs"``: per program key, (action key, start, stop) of each action of its
      latest run;
    * ``"starts"``: per task key, when it last began executing."""
    want = None if keys is None else set(keys)
    delay = float(getattr(dask_worker, "scheduler_delay", 0.0) or 0.0)
    latest: dict[str, int] = {}
    rows = [r for r in list(_LOG) if want is None or r[3] in want]
    for r in rows:
        latest[r[3]] = max(latest.get(r[3], -1), r[4])
    programs: dict[str, list[tuple[str, float, float]]] = {}
    for k, a, b, pk, run in rows:
        if run == latest[pk]:
            programs.setdefault(pk, []).append((k, a + delay, b + delay))
    starts = {k: t + delay for k, t in list(_STARTS) if want is None or k in want}
    return {"programs": programs, "starts": starts}
