"""How `dd.record()` captures a computation: the task stream (and each worker's own log of
its tasks' starts and its direct-dispatch programs' actions) on a distributed cluster, a
Dask callback on the local scheduler, and memory samples around the block."""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Iterator

from dask.callbacks import Callback
from distributed import get_task_stream

from ..cluster.info import current_client, slot_names
from ..errors import ArgumentError
from ..runtime import memory
from ..runtime.direct import compute_log
from ..runtime.direct.inbox import inbox_for
from ..runtime.internals import scheduler_delay
from ..runtime.live import is_live_action
from ..runtime.memory import MemorySample
from .record import Recording, TaskRecord, classify


__all__ = ["record", "SETTLE_FOR"]

#: seconds `record` waits at its end for steps whose values came by push to end
SETTLE_FOR = 2.0
#: key prefixes of direct-dispatch program tasks (`dagdiff.core.keys.make_key`)
PROGRAM_PREFIXES = ("prog_",)


@contextlib.contextmanager
def record(client: Any = None) -> Iterator[Recording]:
    """Capture every task computed inside the block.

    With a distributed client (given, or the current one) it wraps
    `distributed.get_task_stream` (workers named by their slot); otherwise it uses a
    Dask local-scheduler callback (rows are the scheduler's threads). Collect results
    inside the block (``dask.compute``, ``client.compute(...).result()``)."""
    c = client if client is not None else current_client()
    if c is not None and not hasattr(c, "submit") and hasattr(c, "scheduler_address"):
        c = _client_of(c)               # a cluster (dd.local_cluster()): its client
    if c is not None and not hasattr(c, "scheduler_info"):
        raise ArgumentError(f"dd.record takes a distributed Client (or nothing: the current one), "
                            f"got {type(c).__name__} {c!r}; e.g. dd.record(Client(address))")
    rec = Recording()
    if c is not None:
        # steps that ended before the block whose program tasks the scheduler still has
        # running (their values came by push): their end must not land in this block's
        # task stream (a recording held an earlier step.compute's actions)
        _settle(c)
        _sampling(c, memory.start)
        try:
            with get_task_stream(c) as ts:
                try:
                    yield rec
                finally:
                    _settle(c)
        finally:
            samples = _sampling(c, _stop_sampling)
        names = slot_names(c)
        rec.worker_names = dict(names)
        data = [d for d in ts.data if not is_live_action(d)]   # the programs' logs have them
        base = _from_stream(rec, data, _worker_times(c, data))
        rec.memory = {w: _shifted(ss, base) for w, ss in samples.items()}
        return

    lock = threading.Lock()
    starts: dict[Any, tuple[float, str]] = {}
    raw: list[tuple[Any, str, float, float]] = []

    def pretask(key: Any, dsk: Any, state: Any) -> None:
        with lock:
            starts[key] = (time.perf_counter(), threading.current_thread().name)

    def posttask(key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        with lock:
            t, th = starts.pop(key, (time.perf_counter(), "main"))
            raw.append((key, th, t, time.perf_counter()))

    memory.start()
    try:
        with Callback(pretask=pretask, posttask=posttask):
            yield rec
    finally:
        samples = memory.stop()
    threads = sorted({th for _, th, _, _ in raw})
    rec.worker_names = {th: f"thread{i}" for i, th in enumerate(threads)}
    base = min((t for _, _, t, _ in raw), default=0.0)
    for key, th, t, u in raw:
        rec.tasks.append(TaskRecord(str(key), th, t - base, u - base, *classify(key)))
    # samples carry wall-clock times, the tasks perf_counter ones
    rec.memory = {"local": _shifted(samples, base + time.time() - time.perf_counter())}


def _settle(client: Any) -> None:
    """Wait (at most `SETTLE_FOR` s in all; at the start and the end of a block) for the
    tasks of steps whose values the client took by push to end, and for the program tasks the scheduler still has running (a
    `Trainer.step`'s loss comes by push while its program task ends): a program is in
    the task stream only once the scheduler heard of its end."""
    give_up = time.monotonic() + SETTLE_FOR
    box = inbox_for(client, make=False)
    if box is not None:
        box.settle(SETTLE_FOR)
    while time.monotonic() < give_up:
        try:
            running = client.run_on_scheduler(_programs_running, client.id)
        except Exception:                   # noqa: BLE001 - a closing client: nothing to wait
            return
        if not running:
            return
        time.sleep(0.02)


def _programs_running(client_id: str | None = None, dask_scheduler: Any = None) -> int:
    """How many direct-dispatch program tasks the scheduler has processing for client
    `client_id` (it wants the task or a task that reads it; None: for any client). Another
    client's training (a second notebook on the cluster) always has one running: waiting
    for it held each recording 2 s at its start and its end."""
    def mine(ts: Any) -> bool:
        return client_id is None or any(
            c.client_key == client_id for t in (ts, *ts.dependents) for c in t.who_wants or ())

    return sum(1 for ts in dask_scheduler.tasks.values()
               if ts.state == "processing" and isinstance(ts.key, str)
               and ts.key.startswith(PROGRAM_PREFIXES) and mine(ts))


def _stop_sampling(dask_worker: Any = None) -> list[MemorySample]:
    """`memory.stop` on a worker, with its samples' times in the scheduler's clock, as
    its tasks' and actions' times are (`DirectRuntime.compute_log`): the worker's clock
    offset estimate is a few ms even on one machine, as long as a small step."""
    delay = scheduler_delay(dask_worker) if dask_worker is not None else 0.0
    return [s._replace(time=s.time + delay) for s in memory.stop()]


def _sampling(client: Any, fn: Any) -> dict[str, list[MemorySample]]:
    """`fn` (memory.start / memory.stop) on every worker; {} from workers that are gone."""
    try:
        out = client.run(fn, on_error="ignore")
    except Exception:                  # noqa: BLE001 - a worker went away
        return {}
    return {w: [MemorySample(*s) for s in ss] for w, ss in out.items()
            if isinstance(ss, list)}


def _shifted(samples: list[MemorySample], base: float) -> list[MemorySample]:
    return [s._replace(time=s.time - base) for s in samples]


def _worker_times(client: Any, data: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker address, what its process logged (`dagdiff.runtime.direct.runtime.DirectRuntime.compute_log`): the
    actions of direct-dispatch programs, and each task's start in one clock (the task
    stream's times jump with the workers' clock-offset estimates, which can swap
    neighbouring tasks)."""
    keys = sorted({d["key"] for d in data if isinstance(d.get("key"), str)})
    if not keys:
        return {}
    try:
        return client.run(compute_log, keys)
    except Exception:                  # a worker went away: keep the stream's times
        return {}


def _client_of(cluster: Any) -> Any:
    """The current client of `cluster`, or an `ArgumentError` saying to make one."""
    cur = current_client()
    address = getattr(getattr(cur, "scheduler", None), "address", None)
    if cur is not None and address == cluster.scheduler_address:
        return cur
    raise ArgumentError(
        f"dd.record takes a distributed Client, got the cluster {type(cluster).__name__} at "
        f"{cluster.scheduler_address} and no client of it is current; pass its client: "
        "client = distributed.Client(cluster); dd.record(client)")


def _from_stream(rec: Recording, data: list[dict[str, Any]],
                 logs: dict[str, dict[str, Any]] | None = None) -> float:
    """Rows of `rec` from task-stream records (returns the time base subtracted). A record comes when a task finishes and
    carries every start/stop its worker kept for that key, earlier runs of the same key
    too (a step computed a second time): each record adds only its own run, the last
    compute and the transfers after the compute before it. A direct-dispatch program's
    records in the recording are its worker's last runs of it, in order: the j-th of n
    shows the actions of run ``len(runs) - n + j``."""
    rows = []
    logs = logs or {}
    count = collections.Counter((d["worker"], d["key"]) for d in data
                                if d["key"] in logs.get(d["worker"], {}).get("programs", {}))
    seen: collections.Counter[tuple[str, Any]] = collections.Counter()
    for d in data:
        log = logs.get(d["worker"], {})
        programs, starts = log.get("programs", {}), log.get("starts", {})
        for ss in _own_run(d.get("startstops", ())):
            action = ss.get("action")
            if action == "compute" and d["key"] in programs:
                # a direct-dispatch program: a row per action of this run, on its worker
                runs = programs[d["key"]]
                wk = (d["worker"], d["key"])
                n = len(runs) - count[wk] + seen[wk]
                seen[wk] += 1
                if not 0 <= n < len(runs):
                    continue
                for key, start, stop in runs[n]:
                    rows.append((key, d["worker"], start, stop, *classify(key)))
            elif action == "compute":
                known = starts.get(d["key"], [])
                n = _closest(ss["start"], known)
                start = known[n] if n is not None else ss["start"]
                rows.append((d["key"], d["worker"], start, start + ss["stop"] - ss["start"],
                             *classify(d["key"])))
            elif action == "transfer":
                rows.append((d["key"], d["worker"], ss["start"], ss["stop"], "transfer",
                             None, None, None))
    if not rows:
        return 0.0
    base = min(r[2] for r in rows)
    for key, w, a, b, *info in rows:
        rec.tasks.append(TaskRecord(str(key), w, a - base, b - base, *info))
    return base


def _own_run(startstops: Any) -> list[dict[str, Any]]:
    """The start/stops of a task-stream record's own run: its last compute and the
    transfers between the compute before it and that one."""
    ss = list(startstops)
    computes = [i for i, s in enumerate(ss) if s.get("action") == "compute"]
    if not computes:
        return ss
    first = computes[-2] + 1 if len(computes) > 1 else 0
    return ss[first:computes[-1] + 1]


def _closest(t: float, times: list[float], within: float = 0.5) -> int | None:
    """The index of the time in `times` closest to `t` (None if none is `within` s)."""
    if not times:
        return None
    i = min(range(len(times)), key=lambda j: abs(times[j] - t))
    return i if abs(times[i] - t) <= within else None
