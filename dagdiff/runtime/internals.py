"""distributed's internals that dagdiff relies on, in one place (as `taskspec` is for
`dask._task_spec`): every private attribute or function is reached through here, and
`tests/test_internals.py` checks each by name, so a distributed release that changes
one fails that test, naming it, instead of a pipeline step somewhere.

Public API is used wherever it exists; what is left here has no public equivalent:
- scheduler <-> worker batched streams: their flush interval (`BatchedSend.interval`),
  lowered for pipeline hops (`Scheduler.stream_comms`, `Worker.batched_stream`), and
  their debugging log of recent payloads (`BatchedSend.recent_message_log`), shortened;
- task placement after submission: `TaskState.worker_restrictions` /
  `loose_restrictions` (a VJP task pinned to its forward's worker), and the task a
  scheduler TaskState runs (`TaskState.run_spec`: which forward a VJP task reads; a
  program task's run id, stamped fresh as it is submitted);
- the Active Memory Manager's policy set (`ActiveMemoryManagerExtension.policies`);
- the worker's estimate of its clock offset to the scheduler (`Worker.scheduler_delay`);
- raw comms for direct dispatch: `Comm.deserialize`, `Status.dont_reply`,
  `merge_and_deserialize`, NumPy's (de)serializers;
- the socket under a tcp/tls comm (`TCP.stream`, tornado's read buffer), handed from the
  event loop to direct dispatch's lane threads (`take_socket`);
- the task-stream plugin's record format (its `transition` hook), and the events the
  scheduler keeps of a topic (`Broker.truncate`: the workers' action reports);
- `SpecCluster`'s worker-status hook and state correction (`_update_worker_status`,
  `_correct_state`);
- the worker's task states (`Worker.state.tasks`, `TaskState.dependencies` /
  `dependents`): `cut_released_lineage` lets a worker forget the released tasks a chain
  of steps leaves behind (see there).
"""
from __future__ import annotations

import collections
import socket
from typing import Any, Mapping

import dask
from distributed.core import Status
from distributed.deploy.cluster import Cluster
from distributed.protocol.numpy import deserialize_numpy_ndarray, serialize_numpy_ndarray
from distributed.protocol.serialize import merge_and_deserialize


__all__ = ["DONT_REPLY", "merge_and_deserialize", "serialize_numpy_ndarray",
           "deserialize_numpy_ndarray", "stream_comms", "worker_stream", "client_stream",
           "scheduler_client_stream", "shorten_interval", "bound_message_log",
           "forget_topic_events",
           "pin_task", "unpin_task", "task_pinned", "amm_policies", "scheduler_delay", "raw_comm",
           "inline_writes", "take_socket", "task_stream_record", "cluster_status_hook",
           "correct_state", "task_spec", "set_task_spec", "cut_released_lineage", "worker_task",
           "rescheduled", "pinned_to", "REQUIRED"]

#: a handler's return value that tells distributed not to answer on the comm
DONT_REPLY = Status.dont_reply

#: (where, attribute) pairs this module relies on; `tests/test_internals.py` checks them
#: on the installed distributed (the class, or a live instance for instance attributes)
REQUIRED: tuple[tuple[str, str], ...] = (
    ("distributed.core.Status", "dont_reply"),
    ("distributed.protocol.serialize", "merge_and_deserialize"),
    ("distributed.protocol.numpy", "serialize_numpy_ndarray"),
    ("distributed.protocol.numpy", "deserialize_numpy_ndarray"),
    ("distributed.deploy.cluster.Cluster", "_update_worker_status"),
    ("distributed.deploy.spec.SpecCluster", "_update_worker_status"),
    ("distributed.deploy.spec.SpecCluster", "_correct_state"),
    ("distributed.scheduler.TaskState", "worker_restrictions"),
    ("distributed.scheduler.TaskState", "loose_restrictions"),
    ("distributed.scheduler.TaskState", "run_spec"),
    ("Scheduler instance", "stream_comms"),
    ("Scheduler instance", "client_comms"),
    ("Client instance", "scheduler_comm.interval"),
    ("BatchedSend instance", "recent_message_log (a deque)"),
    ("Scheduler instance", "_broker.truncate"),
    ("Scheduler instance", "extensions['amm'].policies"),
    ("Scheduler instance", "plugins['task-stream'].transition"),
    ("Worker instance", "batched_stream.interval"),
    ("Worker instance", "scheduler_delay"),
    ("Comm instance", "deserialize"),
    ("tcp Comm instance", "stream.socket, stream._read_buffer_size (take_socket)"),
    ("Worker instance", "state.tasks[key].dependencies / .dependents / .state"),
    ("Worker instance", "state.tasks[key].run_spec / .run_id (worker_task)"),
    ("distributed.worker.Worker", "execute"),        # a Reschedule's stimulus id
    ("distributed.worker_state_machine.WorkerState", "_transitions"),
)

#: the name distributed's TaskStreamPlugin registers under
TASK_STREAM = "task-stream"


def stream_comms(scheduler: Any) -> Mapping[str, Any]:
    """The scheduler's batched stream to each worker (address -> BatchedSend)."""
    return getattr(scheduler, "stream_comms", {})


def worker_stream(worker: Any) -> Any:
    """The worker's batched stream to the scheduler (a BatchedSend), or None."""
    return getattr(worker, "batched_stream", None)


def client_stream(client: Any) -> Any:
    """A client's batched stream to its scheduler (a BatchedSend; distributed flushes it
    every 10 ms), or None (not connected, an asynchronous or stand-in client)."""
    return getattr(client, "scheduler_comm", None)


def scheduler_client_stream(scheduler: Any, client: Any) -> Any:
    """The scheduler's batched stream to the client named `client` (its id), or None."""
    return getattr(scheduler, "client_comms", {}).get(client)


def shorten_interval(stream: Any, seconds: float | None) -> None:
    """Flush a BatchedSend at least every `seconds` (distributed: 10 ms client->scheduler,
    5 ms scheduler->worker, 2 ms worker->scheduler and scheduler->client); None leaves it."""
    interval = getattr(stream, "interval", None)
    if isinstance(interval, (int, float)) and seconds is not None and seconds < interval:
        stream.interval = seconds


#: dask config key: how many of its latest payloads each message stream dagdiff tunes
#: keeps for debugging (`bound_message_log`)
MESSAGE_LOG_KEY = "dagdiff.message-log-length"


def bound_message_log(stream: Any, length: int | None = None) -> None:
    """Keep only the last `length` payloads (dask config ``dagdiff.message-log-length``,
    default 16) in a BatchedSend's debugging log (``recent_message_log``; distributed
    keeps ``distributed.admin.low-level-log-length``, 1000, of every payload under 1 MB).
    dagdiff's payloads carry whole steps: a window's graph with its batches from the
    client, its programs and batches to each worker. 1000 of them kept every batch of
    the last ~1000 windows alive in the client and the scheduler (measured: the client
    grew ~17 MB per 1000 steps of 16 KB batches, in windows, all of it these logs)."""
    log_ = getattr(stream, "recent_message_log", None)
    if log_ is None:
        return
    if length is None:
        length = int(dask.config.get(MESSAGE_LOG_KEY, 16))
    if log_.maxlen is None or log_.maxlen > length:
        stream.recent_message_log = collections.deque(log_, maxlen=max(0, length))


def forget_topic_events(scheduler: Any, topic: str) -> None:
    """Drop the events the scheduler keeps of `topic` (``Broker.truncate``): the workers'
    action reports (`dagdiff.runtime.live`) are consumed as they come, and the scheduler
    would otherwise keep the last 1000 of them (each 0.1 s of a worker's actions: tens of
    MB on a fast job)."""
    broker = getattr(scheduler, "_broker", None)
    if broker is not None:
        broker.truncate(topic)


def pin_task(ts: Any, workers: set[str]) -> None:
    """Restrict a scheduler TaskState to `workers`, strictly."""
    ts.worker_restrictions = set(workers)
    ts.loose_restrictions = False


def unpin_task(ts: Any) -> None:
    """Drop a restriction set by `pin_task`."""
    if ts.worker_restrictions:
        ts.worker_restrictions = None


def task_spec(ts: Any) -> Any:
    """The task (a ``dask._task_spec`` node) a scheduler TaskState runs, or None."""
    return getattr(ts, "run_spec", None)


def set_task_spec(ts: Any, task: Any) -> None:
    """Make a scheduler TaskState run `task` (a ``dask._task_spec`` node with the same key
    and dependencies) from its next dispatch on; only before it leaves "released"."""
    ts.run_spec = task


def worker_task(worker: Any, key: Any) -> Any:
    """The worker's own state of task `key` (``Worker.state.tasks``: its ``run_spec``, the
    task as the worker was last asked to compute it, and its Dask ``run_id``), or None."""
    return getattr(getattr(worker, "state", None), "tasks", {}).get(key)


#: how the stimulus id of a worker's ``Reschedule`` starts (``Worker.execute``); the
#: scheduler's transitions of that task back to "waiting" carry it
RESCHEDULE_STIMULUS = "reschedule-"


def rescheduled(stimulus_id: Any) -> bool:
    """Whether a scheduler transition comes from a task that raised
    ``distributed.Reschedule`` on its worker (not from a client, a retry or a lost
    worker)."""
    return isinstance(stimulus_id, str) and stimulus_id.startswith(RESCHEDULE_STIMULUS)


def task_pinned(ts: Any) -> bool:
    return bool(ts.worker_restrictions)


def pinned_to(ts: Any) -> set[str]:
    """The worker addresses a scheduler TaskState is restricted to (empty: none)."""
    return set(ts.worker_restrictions or ())


def amm_policies(scheduler: Any) -> Any:
    """The Active Memory Manager's policy set (a set: `.discard` works), or None."""
    amm = getattr(scheduler, "extensions", {}).get("amm")
    return None if amm is None else amm.policies


def scheduler_delay(worker: Any) -> float:
    """The worker's estimate of (scheduler clock - its clock), in seconds."""
    return float(getattr(worker, "scheduler_delay", 0.0) or 0.0)


def raw_comm(comm: Any) -> Any:
    """Make a handler's comm give frames as read (dagdiff deserializes value by value)."""
    comm.deserialize = False
    return comm


def inline_writes(comm: Any) -> Any:
    """Make a comm serialize each write on the event loop without sizing it first:
    distributed walks every message with ``sizeof`` to hand those over 10 MB to a thread,
    ~7% of a worker's event-loop time on direct-dispatch messages of a tiny step; their
    values are arrays, whose serialization takes their buffers without copying."""
    comm.allow_offload = False
    return comm


async def take_socket(comm: Any) -> socket.socket | None:
    """The socket under a tcp or tls comm, taken from the event loop for threads of the
    caller's to read or write (blocking mode), once the comm's pending writes went out;
    None where the comm has no socket of its own (inproc, UCX) or has read bytes beyond the
    last message (they would be lost). Afterwards the comm must not be read or written;
    `comm.abort()` (on the event loop) still closes the socket. Call on the event loop."""
    stream = getattr(comm, "stream", None)
    sock = getattr(stream, "socket", None)
    if stream is None or not isinstance(sock, socket.socket):
        return None
    if stream.writing():
        await stream.write(b"")                 # resolves once the write buffer is empty
    pending = getattr(sock, "pending", None)    # an SSL socket's decrypted, unread bytes
    if stream._read_buffer_size or (pending is not None and pending()):
        return None
    stream.set_close_callback(None)             # no reads of tornado's to notice a close
    stream.io_loop.remove_handler(sock)         # tornado stops watching it
    sock.setblocking(True)
    return sock


def task_stream_record(scheduler: Any, key: str, start: float, stop: float, worker: str,
                       **extra: Any) -> bool:
    """Add a finished-task record to the scheduler's task stream (what the dashboard's
    Task Stream draws), if one is kept; False when none is."""
    stream = scheduler.plugins.get(TASK_STREAM)
    if stream is None:
        return False
    stream.transition(key, "processing", "memory",
                      startstops=[{"action": "compute", "start": start, "stop": stop}],
                      worker=worker, status="OK", nbytes=0, type=None, typename=None,
                      **extra)
    return True


def cluster_status_hook(cluster: Any, base: type, op: str, msg: Any, *,
                        keep_nanny: bool) -> None:
    """A SpecCluster's `_update_worker_status`: with `keep_nanny`, a removed worker goes
    through the plain `Cluster`'s (SpecCluster's closes the nanny of a worker that stays
    away longer than ``distributed.deploy.lost-worker-timeout``); else `base`'s own."""
    if op == "remove" and keep_nanny:
        Cluster._update_worker_status(cluster, op, msg)
    else:
        base._update_worker_status(cluster, op, msg)


def correct_state(cluster: Any) -> None:
    """Wait until a SpecCluster has started the workers of its spec."""
    cluster.sync(cluster._correct_state)


#: worker task states whose task has run: it no longer reads its dependencies
_COMPUTED = frozenset({"memory", "released", "error"})


def cut_released_lineage(worker: Any, key: str) -> int:
    """Unlink the worker's task `key` from the links that keep released tasks alive, and
    forget the released tasks left with nothing depending on them; how many it forgot.
    Call it on the worker's event loop, outside a transition.

    distributed's worker forgets a released task only once no task of its own depends
    on it, and a finished task keeps its links to its dependencies. A chain of steps,
    each reading the state the one before made (a Trainer's picks, on one worker), thus
    kept every released step of the chain, its task and its arguments (each step's
    programs and batch), behind the newest state in memory, long after the scheduler
    forgot them: a worker's memory grew by each batch it read (~75 KB a step with 64 KB
    batches). A finished task (memory, released, error) reads no dependency again, and a
    released one was let go by the scheduler (a task computed again gets its
    dependencies anew with its ``compute-task``): each such link is cut, from `key` to
    its released dependencies and, when `key` is released, from its finished dependents
    to it."""
    state = getattr(worker, "state", None)
    tasks = getattr(state, "tasks", None)
    ts = tasks.get(key) if tasks is not None else None
    if ts is None:
        return 0
    loose = []
    if ts.state in _COMPUTED:
        for dep in list(ts.dependencies):
            if dep.state == "released":
                ts.dependencies.discard(dep)
                dep.dependents.discard(ts)
                dep.waiters.discard(ts)           # a finished task waits for nothing
                loose.append(dep)
    if ts.state == "released":
        for dts in list(ts.dependents):
            if dts.state in _COMPUTED:
                ts.dependents.discard(dts)
                ts.waiters.discard(dts)
                dts.dependencies.discard(ts)
        loose.append(ts)
    recs = {t: "forgotten" for t in loose
            if t.state == "released" and not t.dependents and not t.waiters}
    if recs:
        # what `handle_stimulus` runs for an event; released -> forgotten only purges
        # the task's state, so there are no instructions for the worker to carry out
        instructions = state._transitions(recs, stimulus_id=f"dagdiff-cut-lineage-{key}")
        for inst in instructions:                 # none expected; messages if any
            if hasattr(inst, "to_dict") and hasattr(worker, "batched_send"):
                worker.batched_send(inst.to_dict())
    return len(recs)
