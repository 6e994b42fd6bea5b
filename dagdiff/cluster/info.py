"""What the scheduler says about the workers, and the active client."""
from __future__ import annotations

import concurrent.futures
import time
import weakref
from typing import Any, Collection

from distributed import default_client
from distributed.scheduler import KilledWorker

from ..errors import ClientClosedError, DirectDispatchError, PlacementError, WorkerLostError


__all__ = ["slot_names", "check_open", "workers_info", "latest_workers_info", "current_client",
           "lost_workers", "wait_for_slots", "may_be_a_lost_worker"]


def slot_names(client: Any) -> dict[str, str]:
    """Worker address -> its ``slot<i>`` resource name, read from the scheduler."""
    out = {}
    for addr, w in workers_info(client).items():
        slots = [r for r in (w.get("resources") or {}) if r.startswith("slot")]
        if slots:
            out[addr] = slots[0]
    return out


def check_open(client: Any) -> None:
    """Raise `ClientClosedError` (with the fix) when `client` was closed."""
    status = getattr(client, "status", "running")
    if status in ("closing", "closed") or (status != "running"
                                           and getattr(client, "scheduler", 1) is None):
        raise ClientClosedError(
            f"the distributed Client {getattr(client, 'id', '')} is {status}: make a new one "
            "(client = distributed.Client(cluster)) and use it (dd.Trainer(..., client=client), "
            "or `with client.as_current():`), or compute without a client on local threads")


def workers_info(client: Any) -> dict[str, Any]:
    """Every worker's entry of the scheduler's identity, asked directly: the client's
    cached `scheduler_info()` is also refreshed by a periodic callback that lists no
    workers, which can overwrite it between the refresh and the read. The answer is
    also kept as the client's `latest_workers_info`."""
    check_open(client)
    if not getattr(client, "asynchronous", False):
        try:
            info = dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        except TypeError:                   # an older scheduler without n_workers
            info = dict(client.sync(client.scheduler.identity)["workers"])
    else:
        info = dict(client.scheduler_info()["workers"])
    try:
        _LATEST[client] = info
    except TypeError:                       # not weak-referenceable (a stand-in client)
        pass
    return info


_LATEST: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def latest_workers_info(client: Any) -> dict[str, Any]:
    """The workers as `workers_info` last saw them for this client (asked now if never):
    graph building reads it right after placement asked, without another round trip."""
    info = _LATEST.get(client)
    return info if info is not None else workers_info(client)


def current_client() -> Any:
    """The active distributed client (``Client.as_current()`` or the default), or None."""
    try:
        return default_client()
    except ValueError:
        return None


def may_be_a_lost_worker(error: BaseException) -> bool:
    """Whether `error` is how a step fails when a worker goes away (a direct-dispatch
    program that lost a peer, a cancelled or killed task, a closed comm), so that
    checking for a lost worker is worth a wait; a model's own error is not."""
    return isinstance(error, (DirectDispatchError, WorkerLostError,
                              concurrent.futures.CancelledError,
                              KilledWorker, OSError))


def lost_workers(client: Any, addresses: Collection[str], wait: float = 10.0) -> tuple[str, ...]:
    """Which of `addresses` (the workers a failed step ran on) the scheduler no longer
    has, waiting up to `wait` seconds for it to notice a loss (an empty answer: no
    worker was lost, the step failed for another reason)."""
    deadline = time.monotonic() + wait
    while True:
        current = set(workers_info(client))
        gone = tuple(sorted(a for a in addresses if a not in current))
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.2)


def wait_for_slots(client: Any, slots: Collection[str], timeout: float = 300.0) -> None:
    """Wait until a worker with each of `slots` (``slot<i>`` resources) is running: a lost
    worker's nanny starts its replacement with the same slot."""
    want = set(slots)
    deadline = time.monotonic() + timeout
    while True:
        have = set(slot_names(client).values())
        if want <= have:
            return
        if time.monotonic() >= deadline:
            raise PlacementError(
                f"no worker came back for {', '.join(sorted(want - have))} "
                f"within {timeout:g} s (running: {', '.join(sorted(have)) or 'none'}); start "
                "workers with those resources (dask worker --resources slot<i>=1), or "
                "resume later from a checkpoint")
        time.sleep(0.25)
