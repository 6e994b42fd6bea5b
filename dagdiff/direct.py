"""Direct dispatch: a pipeline step's tasks reach their workers at once; each worker runs
them in its schedule order and sends activations and cotangents straight to the worker
that consumes them, so no action waits for a scheduler round trip.

On distributed every dependent hop costs a scheduler round trip plus a transfer (5-10 ms
measured on a small machine), which is as long as a pipeline action itself. Here the
graph is rewritten before submission (`rewrite`): tasks of the step that live on a worker
lose their Dask dependencies on each other and get

* a position in their worker's order: the schedule's actions in order, the small tasks
  (microbatch slices, sums, accumulators) where a simulated run of the schedule first has
  their inputs (`linearize`, which also rejects a schedule that would deadlock);
* an inbox per input: same-worker values are handed over in process, other workers'
  values arrive through one direct message (`dagdiff.channel`);
* a route for their own value: local consumers, and each other worker that reads it.

Tasks read by ordinary tasks (the step's outputs) still return their value to Dask,
the others return None; one ``done`` task per worker depends on all of the worker's
tasks and every output waits for all of them, so a failure anywhere reaches the caller
and no task of a step is released while any of its outputs is wanted. Failures travel
downstream as error messages, cancelled steps wake their waiters, and every wait has a
deadline (``dagdiff.direct.timeout``, default 600 s): nothing waits forever.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import uuid
import weakref
from typing import Any, Callable, Mapping

from dask._task_spec import DataNode, Task, TaskRef

from .errors import DagdiffError, PlacementError
from .keys import make_key

__all__ = [
    "DirectDispatchError",
    "UpstreamError",
    "DirectPlan",
    "rewrite",
    "linearize",
    "direct_task",
    "install_handlers",
    "endpoint",
    "endpoints",
    "compute_log",
    "RESOURCE_SHARE",
]

log = logging.getLogger(__name__)

#: share of a slot resource one direct task holds: a task that waits for its turn leaves
#: the thread pool (``secede``) but keeps its resources, so whole units would block the
#: worker's next task (2**-20: exact in binary, a million tasks per worker)
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
    uses: int                     # consumer tasks there


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one task's value goes: `local` consumer tasks on its worker, and the
    consumers on other workers."""

    local: int
    remote: tuple[Remote, ...]


@dataclasses.dataclass(frozen=True)
class DirectInfo:
    """What a direct task needs at run time besides its function and arguments."""

    step: str                       # id shared by all tasks of the step, on every worker
    key: str
    where: str                      # worker slot (or address), for messages
    pos: int                        # position in this worker's order
    count: int                      # tasks of this step on this worker
    inputs: tuple[tuple[str, str], ...]   # (producer key, producer's worker) per inbox
    route: Route
    returns: bool                   # an ordinary task reads the value from Dask
    timeout: float


class _Inbox:
    """Placeholder argument: the value of direct task `key`, delivered in process."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __reduce__(self) -> Any:
        return (_Inbox, (self.key,))

    def __repr__(self) -> str:
        return f"<inbox {self.key}>"


@dataclasses.dataclass
class DirectPlan:
    """The rewritten graph: tasks, the order per worker, per-key priorities, and the
    step's completion tasks."""

    dsk: dict[str, Any]
    order: dict[str, list[str]]        # worker -> direct keys in run order
    priority: dict[str, int]
    done_keys: dict[str, str]          # completion task -> its worker


def rewrite(dsk: Mapping[str, Any], worker_of: Mapping[str, str | None],
            priority: Mapping[str, int], keep: set[str], addresses: Mapping[str, str],
            token: str, slots: bool = True,
            timeout: float | None = None,
            endpoints: Mapping[str, Any] | None = None) -> DirectPlan:
    """Turn every task that has a worker (and is not in `keep`, the step's outputs, and
    does not wait on an ordinary task) into a direct task.

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
    readers: dict[str, list[str]] = collections.defaultdict(list)
    for k, ds in inbox.items():
        for d in ds:
            readers[d].append(k)
    returns = {d for k, t in dsk.items() if k not in direct and isinstance(t, Task)
               for d in t.dependencies if d in direct}
    order = linearize(inbox, {k: worker_of[k] for k in direct},
                      {k: priority[k] for k in direct if k in priority})
    pos = {k: i for keys in order.values() for i, k in enumerate(keys)}
    step = f"{token}-{uuid.uuid4().hex[:12]}"
    base = -10_000_000 * next(_COUNTER)      # later steps rank below earlier ones on every worker
    out_priority: dict[str, int] = {}
    for k in direct:
        t, w = dsk[k], worker_of[k]
        by_worker = collections.Counter(worker_of[c] for c in readers.get(k, ()))
        local = by_worker.pop(w, 0)
        route = Route(local, tuple(
            Remote(ww, addr(ww), (endpoints or {}).get(addr(ww)), n)
            for ww, n in sorted(by_worker.items())))
        inputs = tuple((d, worker_of[d]) for d in inbox[k])
        info = DirectInfo(step, k, w, pos[k], len(order[w]), inputs, route, k in returns,
                          timeout)
        args = tuple(_Inbox(a.key) if isinstance(a, TaskRef) and a.key in direct else a
                     for a in t.args)
        kwargs = {n: (_Inbox(v.key) if isinstance(v, TaskRef) and v.key in direct else v)
                  for n, v in t.kwargs.items() if not _ordering_only(n, v, direct)}
        dsk[k] = Task(k, direct_task, info, t.func, *args, **kwargs)
        out_priority[k] = base - pos[k]
    # One completion task per worker over all of its direct tasks (local: nothing moves),
    # and every output waits for all of them: while any output is wanted no task of the
    # step is released (a released task would never take its turn), and a failure
    # anywhere reaches every output.
    done_keys: dict[str, str] = {}
    for i, w in enumerate(sorted(order)):
        dk = make_key("done", "step", i, token)
        dsk[dk] = Task(dk, _done, *[TaskRef(k) for k in order[w]])
        done_keys[dk] = w
    refs = [TaskRef(dk) for dk in done_keys]
    for k, t in list(dsk.items()):
        if k in keep and isinstance(t, Task):
            dsk[k] = Task(k, _after, len(refs), *refs, t.func, *t.args, **t.kwargs)
    return DirectPlan(dsk, order, out_priority, done_keys)


def _ordering_only(name: str, value: Any, direct: set[str]) -> bool:
    """`after_<i>` keyword arguments are the scheduler-mode ordering edges; direct tasks
    are ordered by their position instead."""
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


def _done(*values: Any) -> None:
    """Completion of a direct step on one worker (its inputs: all the worker's tasks)."""
    return None


def _after(n: int, *rest: Any, **kwargs: Any) -> Any:
    """An output task that also waits for the step's `n` completion tasks."""
    func, args = rest[n], rest[n + 1:]
    return func(*args, **kwargs)


# --- run time: the worker side ----------------------------------------------------------

class _Entry:
    """A started direct task, waiting to be run by its own thread or by the thread that
    ran its predecessor on the worker."""

    __slots__ = ("info", "func", "args", "kwargs", "state", "result", "error", "wake")

    def __init__(self, info: DirectInfo, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.info, self.func, self.args, self.kwargs = info, func, args, kwargs
        self.state = "new"                 # new -> running -> done
        self.result: Any = None
        self.error: BaseException | None = None
        self.wake = threading.Event()      # set when something this task waits for changed


class _Step:
    """One step's state on one worker: whose turn it is, started tasks, values and
    errors received for them. Waiters sleep on their own entry's event and are woken one
    by one (a step-wide condition woke every parked thread on every event)."""

    def __init__(self) -> None:
        self.cond = threading.Lock()
        self.turn = 0
        self.entries: dict[int, _Entry] = {}
        self.values: dict[str, list[Any]] = {}      # key -> [value, uses left]
        self.errors: dict[str, str] = {}
        self.waiting: dict[str, _Entry] = {}        # input key -> the task waiting for it
        self.abort: str | None = None

    def wake_turn(self) -> None:
        """(lock held) Wake the task whose turn it now is."""
        e = self.entries.get(self.turn)
        if e is not None:
            e.wake.set()

    def wake_key(self, key: str) -> None:
        """(lock held) Wake the task waiting for input `key`."""
        e = self.waiting.get(key)
        if e is not None:
            e.wake.set()


# state per (step, worker): several workers may share a process (processes=False)
_STEPS: dict[tuple[str, str], _Step] = {}
_FINISHED: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
_RUNNING: dict[str, tuple[str, str]] = {}           # task key -> its step (cancellations)
_GLOBAL = threading.Lock()
_LOG: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=200_000)
_THREAD = threading.local()


def _step(step: tuple[str, str]) -> _Step | None:
    with _GLOBAL:
        if step in _FINISHED:
            return None
        st = _STEPS.get(step)
        if st is None:
            st = _STEPS[step] = _Step()
        return st


def _finish(step: tuple[str, str]) -> None:
    with _GLOBAL:
        _STEPS.pop(step, None)
        _FINISHED[step] = None
        while len(_FINISHED) > 1024:
            _FINISHED.popitem(last=False)


def direct_task(info: DirectInfo, func: Callable[..., Any], /, *args: Any,
                **kwargs: Any) -> Any:
    """Run `func` when it is this task's turn on its worker and its inbox inputs have
    arrived; hand its value to its consumers (in process or by direct message).

    The task registers itself and leaves the thread pool at once, so all of a step's
    tasks wait in their own threads. Whichever thread finishes a task goes on with the
    worker's next task when that one is registered and its inputs are there: a worker
    runs its actions back to back without waking a thread (or the event loop) per task.
    """
    here = (info.step, info.where)
    st = _step(here)
    if st is None:
        raise DirectDispatchError(
            f"{info.key} on {info.where}: this step already ended on this worker (it "
            "finished, failed or was cancelled) and Dask runs its task again, e.g. after "
            "a worker was lost mid-step. Run the step again.")
    entry = _Entry(info, func, args, kwargs)
    _RUNNING[info.key] = here
    try:
        with st.cond:
            st.entries[info.pos] = entry
        _secede()
        mine = False
        try:
            _wait(st, entry, lambda: entry.state == "done" or (
                  entry.state == "new" and st.turn >= info.pos),
                  lambda: f"its turn (task {info.pos} of {info.count} on {info.where}; "
                          f"{st.turn} ran so far)")
            with st.cond:
                if entry.state == "new":
                    entry.state, mine = "running", True
        except BaseException as e:            # aborted or timed out while waiting
            with st.cond:
                if entry.state == "new":
                    entry.state, entry.error = "done", e
            if entry.state == "done" and entry.error is e:
                _settle(st, entry, None, e)
                _next(st, info)
            raise
        if mine:
            _run_chain(st, entry)
        else:
            _wait(st, entry, lambda: entry.state == "done",
                  lambda: "the thread running it (ran by its predecessor's thread)")
    finally:
        _RUNNING.pop(info.key, None)
    if entry.error is not None:
        raise entry.error
    return entry.result if info.returns else None


def _run_chain(st: _Step, entry: _Entry) -> None:
    """Run `entry` (claimed by this thread), then each following task of the worker
    that is registered and has its inputs, until one is not ready."""
    while entry is not None:
        _run(st, entry)
        info = entry.info
        with st.cond:
            st.turn = max(st.turn, info.pos + 1)
            nxt = st.entries.get(st.turn)
            if nxt is not None and nxt.state == "new" and _ready(st, nxt.info):
                nxt.state = "running"
            else:
                nxt = None
                st.wake_turn()
            last = st.turn >= info.count
        if last:
            _finish((info.step, info.where))
        entry = nxt


def _ready(st: _Step, info: DirectInfo) -> bool:
    return all(k in st.values or k in st.errors for k, _ in info.inputs) and st.abort is None


def _run(st: _Step, entry: _Entry) -> None:
    """Take the inputs, call the function, hand the value on (or the error)."""
    from distributed.metrics import time

    info = entry.info
    try:
        got = {k: _take(st, entry, k, src) for k, src in info.inputs}
        a = [got[x.key] if isinstance(x, _Inbox) else x for x in entry.args]
        kw = {n: (got[v.key] if isinstance(v, _Inbox) else v)
              for n, v in entry.kwargs.items()}
        t0 = time()
        out = entry.func(*a, **kw)
        t1 = time()
    except BaseException as e:
        _settle(st, entry, None, e)
        return
    _LOG.append((info.key, t0, t1))
    _settle(st, entry, out, None)


def _settle(st: _Step, entry: _Entry, value: Any, error: BaseException | None) -> None:
    """Hand the outcome to local consumers, send it to remote ones, then record it (a
    value that cannot be delivered fails its task, so the caller hears of it)."""
    info = entry.info
    msg = None
    if error is not None:
        msg = str(error) if isinstance(error, (UpstreamError, DirectDispatchError)) else \
            f"{info.key} failed on {info.where}: {type(error).__name__}: {error}"
    if info.route.local:
        with st.cond:
            if msg is None:
                st.values[info.key] = [value, info.route.local]
            else:
                st.errors[info.key] = msg
            st.wake_key(info.key)
    try:
        _send(info, value, msg)
    except DirectDispatchError as e:
        if error is None:
            error = e
    with st.cond:
        entry.state, entry.result, entry.error = "done", value, error
        entry.args = entry.kwargs = None      # type: ignore[assignment]  (free inputs)
        st.entries.pop(info.pos, None)
        entry.wake.set()


def _next(st: _Step, info: DirectInfo) -> None:
    """Pass the turn on after a task that ended without running (abort, timeout)."""
    with st.cond:
        st.turn = max(st.turn, info.pos + 1)
        st.wake_turn()
        last = st.turn >= info.count
    if last:
        _finish((info.step, info.where))


def _secede() -> None:
    """Leave the worker's thread pool (once per task): the worker then starts its next
    tasks, and a task that waits never keeps the task whose turn it is from starting."""
    if getattr(_THREAD, "seceded", False):
        return
    from distributed import secede

    try:
        secede()
        _THREAD.seceded = True               # the thread ends with its task
    except Exception:                        # not inside a worker task (tests, threads)
        pass


def _take(st: _Step, entry: _Entry, key: str, src: str) -> Any:
    with st.cond:
        st.waiting[key] = entry
    try:
        _wait(st, entry, lambda: key in st.values or key in st.errors,
              lambda: f"input {key} from {src}")
    finally:
        with st.cond:
            st.waiting.pop(key, None)
    with st.cond:
        if key in st.errors:
            raise UpstreamError(st.errors[key])
        value = st.values[key]
        value[1] -= 1
        if value[1] <= 0:
            del st.values[key]
        return value[0]


def _wait(st: _Step, entry: _Entry, ready: Callable[[], bool],
          what: Callable[[], str]) -> None:
    """Sleep on the entry's event until `ready()` (checked under the step's lock); raise
    on abort or after the entry's timeout, saying what was awaited."""
    import time as _time

    info = entry.info
    deadline = _time.monotonic() + info.timeout
    while True:
        with st.cond:
            if ready():
                return
            if st.abort is not None:
                raise DirectDispatchError(f"{info.key} on {info.where}: {st.abort}")
            entry.wake.clear()
        left = deadline - _time.monotonic()
        if left <= 0:
            raise DirectDispatchError(
                f"{info.key} on {info.where} waited {info.timeout:g} s for {what()}: a "
                "worker was lost or restarted mid-step, or an upstream task hangs. Run "
                "the step again; raise dask config 'dagdiff.direct.timeout' if tasks "
                "legitimately take longer; dispatch='scheduler' recomputes lost work.")
        entry.wake.wait(min(left, 1.0))


def _send(info: DirectInfo, value: Any, error: str | None) -> None:
    """Send the value (or error) to the consumers on other workers; raises
    `DirectDispatchError` naming the first consumer worker that could not be reached."""
    if not info.route.remote:
        return
    wire = _wire(value) if error is None else None
    failed = []
    for r in info.route.remote:
        msg = {"step": info.step, "where": r.where, "key": info.key, "uses": r.uses,
               "error": error, "value": wire}
        try:
            if r.endpoint is None:
                raise DirectDispatchError(f"no dagdiff channel on {r.address}")
            from .channel import send

            send(r.endpoint, msg)
        except Exception as e:
            failed.append(f"{r.where} at {r.address} ({type(e).__name__}: {e})")
    if failed:
        raise DirectDispatchError(
            f"{info.key} on {info.where} could not send its value to "
            f"{'; '.join(failed)}. Is that worker alive and running dagdiff (start workers "
            "with --preload dagdiff)? Run the step again, or use dispatch='scheduler'.")


def _wire(value: Any) -> Any:
    """What another worker receives: forward results without their pullback, and jax
    arrays as NumPy arrays (pickled without JAX's reconstruction cost; the consumer's
    jitted function puts them on its device)."""
    import jax
    import numpy as np

    from .tasks import FwdResult

    def host(x: Any) -> Any:
        return np.asarray(x) if isinstance(x, jax.Array) else x

    if isinstance(value, FwdResult):
        return FwdResult([host(x) for x in value.out], None, moved=True,
                         res=jax.tree_util.tree_map(host, value.res))
    if isinstance(value, (tuple, list)):
        return type(value)(_wire(v) for v in value)
    return host(value)


def _deliver(msg: dict[str, Any]) -> None:
    """A value (or error) for consumers of `msg['key']` on worker `msg['where']`."""
    st = _step((msg["step"], msg["where"]))
    if st is None:
        return                                   # a late message for a finished step
    with st.cond:
        if msg.get("error") is None:
            st.values[msg["key"]] = [msg["value"], msg["uses"]]
        else:
            st.errors[msg["key"]] = msg["error"]
        st.wake_key(msg["key"])


def _abort(step: tuple[str, str], reason: str) -> None:
    """Wake every waiter of `step` on this worker with `reason`, and forget the step
    (late messages for it are dropped; its tasks that never started never will)."""
    with _GLOBAL:
        st = _STEPS.get(step)
    if st is None:
        return
    with st.cond:
        if st.abort is None:
            st.abort = reason
        for e in st.entries.values():
            e.wake.set()
    _finish(step)


def cancelled(key: str) -> None:
    """A direct task was cancelled while running (the client released the step): abort
    its step here so its waiting tasks end instead of holding threads."""
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


_ENDPOINTS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def endpoints(client: Any, addresses: set[str]) -> dict[str, Any]:
    """Channel endpoint per worker address (asked once per worker through `Client.run`;
    None for a worker without one)."""
    if client is None or not addresses:
        return {}
    cache = _ENDPOINTS.setdefault(client, {})
    missing = sorted(a for a in addresses if a not in cache)
    if missing:
        try:
            cache.update(client.run(endpoint, workers=missing))
        except Exception as e:
            log.warning("dagdiff: could not ask workers for direct channels (%s)", e)
    return {a: cache.get(a) for a in addresses}


def endpoint(dask_worker: Any = None) -> Any:
    """This worker's channel endpoint, or None (run on workers through `Client.run`)."""
    return getattr(dask_worker, "_dagdiff_channel", None)


def compute_log(keys: Any = None, dask_worker: Any = None) -> dict[str, tuple[float, float]]:
    """(start, stop) of the compute part of direct tasks run in this process (the task
    stream also counts the wait for a task's turn and inputs). Times are shifted into
    the scheduler's clock with one offset for all of them, so their order on a worker is
    exactly the order they ran in."""
    want = None if keys is None else set(keys)
    delay = float(getattr(dask_worker, "scheduler_delay", 0.0) or 0.0)
    return {k: (a + delay, b + delay) for k, a, b in list(_LOG)
            if want is None or k in want}
