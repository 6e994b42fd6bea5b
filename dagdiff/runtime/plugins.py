"""dagdiff's Dask plugins: on the scheduler, each VJP task runs on the worker holding its
forward's pullback (and direct-dispatch actions reach the task stream, `LiveActions`); on
every worker, dagdiff is loaded and its direct-dispatch runtime installed.

Pullbacks are unpicklable, so a VJP task placed elsewhere has to rematerialize. When a
forward task's result lands in memory, the plugin restricts the backward tasks that read
their pullback from it (the forward each `vjp_task` takes as an argument:
`runtime.tasks.pullback_of`, read off the task itself, not its key) to its worker; when
the result is lost (worker gone), the restriction is lifted so nothing waits forever on a
dead worker.
"""
from __future__ import annotations

import logging
import weakref
from time import time
from typing import Any, Iterable

import dask
from dask.utils import parse_timedelta
from distributed.active_memory_manager import ReduceReplicas
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from .direct import install
from .direct.runtime import NONCE_TAKERS, PEER_LOST_OP, stamp_run_nonces
from .internals import (amm_policies, bound_message_log, client_stream,
                        cut_released_lineage, pin_task, pinned_to, rescheduled,
                        scheduler_client_stream, set_task_spec, shorten_interval,
                        stream_comms, task_spec, unpin_task, worker_stream)
from .live import LiveActions
from .serialize import register
from .tasks import pullback_of
from .worker_jax import configure_worker_jax


__all__ = ["ColocateVJP", "ensure_colocation", "MEMBERSHIP_TOPIC", "is_registered", "known_keys",
           "MEMORY_METRIC", "memory_enforced",
           "memory_enforced_here"]

#: the scheduler event topic on which `ColocateVJP` announces every worker that joins or
#: leaves (clients keep their list of workers until it changes: `cluster.info`)
MEMBERSHIP_TOPIC = "dagdiff-membership"

log = logging.getLogger(__name__)


def _latency() -> float | None:
    """Seconds between flushes of distributed's batched message streams (None: keep
    distributed's defaults); dask config ``dagdiff.batched-send-interval``."""
    value = dask.config.get("dagdiff.batched-send-interval", "1ms")
    return None if value in (None, "default") else parse_timedelta(value, default="ms")


_registered: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: the schedulers of this process that run dagdiff's plugin (`known_keys`)
_schedulers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def known_keys(keys: Iterable[Any]) -> set[Any] | None:
    """The keys among `keys` that a scheduler of this process has a task of, in any state
    (computing such a key again keeps that task, and its dependencies, as they are), or
    None where no scheduler with dagdiff's plugin runs here (a graph materialized
    elsewhere than on its scheduler)."""
    schedulers = list(_schedulers)
    if not schedulers:
        return None
    return {k for k in keys if any(k in s.tasks for s in schedulers)}


class ColocateVJP(SchedulerPlugin):
    """dagdiff's scheduler plugin: pin each backward task to the worker where the forward
    task it reads its pullback from ran (unless the user pinned it with a ``workers=``
    annotation); stamp a fresh run id on each direct-dispatch program task as it is
    submitted or run again (`stamp_run_nonces`); flush message streams every
    `_latency()`; tell clients and workers when a worker joins or leaves."""

    name = "dagdiff-colocate-vjp"
    idempotent = True                  # registered once per cluster, by its first client

    def __init__(self) -> None:
        self.scheduler: Any = None
        #: keys of forward tasks some backward task reads a pullback from: the only keys
        #: whose transitions this plugin looks at (one set lookup for every other task)
        self._forwards: set[Any] = set()
        #: the stimulus whose program tasks `_fresh` holds the new run ids of
        self._stimulus: Any = None
        self._fresh: dict[str, Any] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        _schedulers.add(scheduler)
        for addr in list(stream_comms(scheduler)):
            self.add_worker(scheduler, addr)
        _keep_forward_replicas(scheduler)

    def add_worker(self, scheduler: Any = None, worker: Any = None) -> None:
        """Low-latency mode: flush scheduler->worker messages every `_latency()` s (5 ms in
        distributed), so a dependent chain of tasks waits less between hops."""
        stream = stream_comms(self.scheduler).get(worker)
        shorten_interval(stream, _latency())
        bound_message_log(stream)
        self._announce("add", worker)

    def remove_worker(self, scheduler: Any = None, worker: Any = None, **kwargs: Any) -> None:
        """Tell the clients (`MEMBERSHIP_TOPIC`) and every other worker: a direct-dispatch
        program there that waits on the removed worker fails now, not after a probe. The
        workers hear it on the scheduler's batched stream to each (in order with their
        tasks, no new connection); a worker whose stream is closing (the whole cluster
        shuts down) is skipped without a word: distributed's ``broadcast`` logged an ERROR
        for each worker that closed meanwhile."""
        self._announce("remove", worker)
        if self.scheduler is None or worker is None:
            return
        self._unpin_from(worker)
        msg = {"op": PEER_LOST_OP, "address": worker}
        for address, stream in list(stream_comms(self.scheduler).items()):
            if address == worker:
                continue
            try:
                stream.send(msg)
            except Exception:           # noqa: BLE001 - that worker's stream closed
                log.debug("dagdiff: could not tell %s that %s left", address, worker)

    def _unpin_from(self, worker: str) -> None:
        """Let the backward tasks pinned to a removed worker (their forward ran there) run
        elsewhere: where the forward's value survives on another worker (a replica), it
        does not change state, so `transition` would never move them, and they waited
        for the gone address forever (``dispatch="scheduler"``, a worker killed
        mid-step). Their pullback went with the worker; the backward remakes it from the
        forward's inputs wherever it runs (`dd.remat_count`)."""
        stuck = {}
        for key in list(self._forwards):
            ts = self.scheduler.tasks.get(key)
            for dts in (ts.dependents if ts is not None else ()):
                if (pullback_of(task_spec(dts)) == key and worker in pinned_to(dts)
                        and "workers" not in (dts.annotations or {})):
                    unpin_task(dts)
                    if dts.state == "no-worker":
                        stuck[dts.key] = "waiting"
        if stuck and self.scheduler.workers:
            self.scheduler.transitions(stuck, stimulus_id=f"dagdiff-unpin-{time()}")

    def _announce(self, action: str, worker: Any) -> None:
        """Tell the clients that the set of workers changed (`MEMBERSHIP_TOPIC`)."""
        if self.scheduler is not None:
            self.scheduler.log_event(MEMBERSHIP_TOPIC, {"action": action, "worker": worker})

    def update_graph(self, scheduler: Any, *, tasks: Any = (), client: Any = None,
                     **kwargs: Any) -> None:
        """Note the forward tasks the new graph's backward tasks read pullbacks from; and
        answer the submitting client every `_latency()` s (2 ms in distributed)."""
        stream = scheduler_client_stream(scheduler, client)
        shorten_interval(stream, _latency())
        bound_message_log(stream)
        known = scheduler.tasks
        for k in tasks:
            f = pullback_of(task_spec(known.get(k)))
            if f is not None:
                self._forwards.add(f)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if start == "released" and finish == "waiting":
            self._stamp(key, kwargs.get("stimulus_id"))
        if key not in self._forwards:
            return
        if finish == "forgotten":
            self._forwards.discard(key)
            return
        if finish != "memory" and start != "memory":
            return
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        if ts is None:
            return
        pin = None
        if finish == "memory" and ts.who_has:
            pin = {next(iter(ts.who_has)).address}
        for dts in ts.dependents:
            if (pullback_of(task_spec(dts)) == key
                    and "workers" not in (dts.annotations or {})):  # explicit placement wins
                if pin is not None:
                    pin_task(dts, pin)
                else:
                    unpin_task(dts)

    def _stamp(self, key: Any, stimulus: Any) -> None:
        """A program task about to run (again): a fresh run id in place of the one its
        graph carries, shared by the programs of its step, which one stimulus (a graph's
        submission, a retry) sends together. It runs at once, with no nonce task."""
        if stimulus is None or self.scheduler is None or rescheduled(stimulus):
            # its program raised Reschedule: its thread was stale (released and resumed
            # by its worker under the old id); it runs again under the id it was stamped
            # with, which the other programs of its step run under
            return
        spec = task_spec(self.scheduler.tasks.get(key))
        func = getattr(spec, "func", None)
        if not any(func is f for f in NONCE_TAKERS):
            return
        if stimulus != self._stimulus:
            self._stimulus, self._fresh = stimulus, {}
        stamped = stamp_run_nonces(spec, self._fresh)
        if stamped is not None:
            set_task_spec(self.scheduler.tasks[key], stamped)


#: the worker metric (heartbeats, the scheduler's identity) holding `memory_enforced`
MEMORY_METRIC = "dagdiff_memory_enforced"


def memory_enforced(worker: Any) -> list[float]:
    """[pause, terminate]: the shares of its memory_limit at which this worker pauses
    and at which its nanny restarts it (0: never; no nanny, no restart)."""
    manager = getattr(worker, "memory_manager", None)
    pause = getattr(manager, "memory_pause_fraction", None)
    if pause is None:
        pause = dask.config.get("distributed.worker.memory.pause", False)
    terminate = (dask.config.get("distributed.worker.memory.terminate", False)
                 if getattr(worker, "nanny", None) else False)
    return [float(pause or 0.0), float(terminate or 0.0)]


def memory_enforced_here(dask_worker: Any) -> list[float]:
    """`memory_enforced` of the worker it runs on (for ``client.run``)."""
    return memory_enforced(dask_worker)


class LoadDagdiff(WorkerPlugin):
    """Import dagdiff on every worker (present and future) so that its serializers for
    jax arrays are registered before any data arrives, and install the worker's
    direct-dispatch runtime (`dagdiff.runtime.direct.runtime.DirectRuntime`)."""

    name = "dagdiff-load"
    #: a second client's registration keeps the workers' copy (distributed would otherwise
    #: tear down and set up the plugin on every worker)
    idempotent = True
    worker: Any = None

    def setup(self, worker: Any) -> None:
        register()                  # sizeof and serializers of jax arrays (idempotent)
        configure_worker_jax(worker)   # no effect once the process computed with JAX
        self.runtime = install(worker)
        self.worker = worker
        # worker->scheduler: 2 ms by default
        shorten_interval(worker_stream(worker), _latency())
        bound_message_log(worker_stream(worker))
        # where this worker's memory limit is enforced, in its heartbeat's metrics: the
        # build's memory check reads it (`lowering.memory`)
        worker.metrics.setdefault(MEMORY_METRIC, memory_enforced)

    def _cut(self, key: str) -> None:
        try:
            cut_released_lineage(self.worker, key)
        except Exception:                  # noqa: BLE001 - never fail the worker for it
            log.debug("dagdiff: could not let go of the tasks behind %s", key, exc_info=True)

    def teardown(self, worker: Any) -> None:
        """Nothing to undo: the runtime belongs to the worker (its extension ``"dagdiff"``,
        closed by the worker's own close), not to this plugin. Closing it here broke direct
        dispatch for every client of the cluster whenever the plugin was replaced."""
        self.runtime = None

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Log when each task starts (exact per-worker order for `dd.record`); a running
        direct-dispatch program released by the scheduler (the client let go of the
        step, e.g. after an error) wakes and stops; a task that finished or was released
        lets go of the released tasks behind it (`internals.cut_released_lineage`: a
        chain of steps kept every step's programs and batch on the worker)."""
        rt = getattr(self, "runtime", None)
        if rt is None or not isinstance(key, str):
            return
        if finish in ("memory", "released") and self.worker is not None:
            # after this transition: the worker's state may not change inside it
            self.worker.loop.add_callback(self._cut, key)
        if finish == "executing":
            rt.started(key)
        elif start in ("executing", "long-running") and finish in ("released", "cancelled"):
            rt.cancel(key)


def _keep_forward_replicas(scheduler: Any) -> None:
    """Stop the Active Memory Manager's ReduceReplicas policy: it may drop the original
    forward result (the one holding the pullback) and keep a consumer's copy, which forces
    the VJP task to fetch the copy back and rematerialize."""
    policies = amm_policies(scheduler)
    if policies is None:
        return
    for policy in list(policies):
        if isinstance(policy, ReduceReplicas):
            policies.discard(policy)
            log.info("dagdiff: removed the AMM ReduceReplicas policy (keeps pullbacks local)")


def is_registered(client: Any) -> bool:
    """Whether `ensure_colocation` registered dagdiff's plugins through `client` (so its
    scheduler announces membership changes)."""
    try:
        return client in _registered
    except TypeError:
        return False


def ensure_colocation(client: Any) -> bool:
    """Register `ColocateVJP` and `LiveActions` (direct-dispatch actions in the dashboard)
    on `client`'s scheduler and `LoadDagdiff` on its workers, once per client; False if
    that is impossible. Each call also sets the client's own message stream to the
    scheduler to flush every `_latency()` s (distributed: 10 ms, a step's first wait; set
    again per call, as a reconnected client has a new stream)."""
    shorten_interval(client_stream(client), _latency())
    bound_message_log(client_stream(client))
    if client in _registered:
        return True
    try:
        if getattr(client, "asynchronous", False):
            return False
        # all idempotent: a cluster's first client registers them, the others keep them
        for plugin in (ColocateVJP(), LiveActions(), LoadDagdiff()):
            client.register_plugin(plugin, name=plugin.name)
    except Exception as e:  # e.g. dagdiff not installed where the scheduler runs
        log.warning("dagdiff: could not register dagdiff's scheduler plugin (%s): VJP tasks "
                    "may rematerialize pullbacks (see dd.remat_count), and a direct-dispatch "
                    "step's Delayed computed a second time raises (call the step again); "
                    "install dagdiff where the scheduler runs", e)
        return False
    _registered.add(client)
    return True
