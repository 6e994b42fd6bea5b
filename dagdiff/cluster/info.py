"""What the scheduler says about the workers, and the active client."""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
import weakref
from typing import Any, Callable, Collection

from distributed import default_client
from distributed.scheduler import KilledWorker

from ..errors import ClientClosedError, DirectDispatchError, WorkerLostError


__all__ = ["slot_names", "seen_slots", "on_worker_removed", "check_open", "workers_info",
           "forget_workers", "current_client", "lost_workers", "may_be_a_lost_worker",
           "MEMBERSHIP_TTL"]

#: seconds a client's cached list of workers is used without asking the scheduler again
#: (it is dropped at once when the scheduler announces a worker joining or leaving)
MEMBERSHIP_TTL = 10.0


def slot_names(client: Any, cached: bool = False) -> dict[str, str]:
    """Worker address -> its ``slot<i>`` resource name, read from the scheduler (or, with
    `cached`, from the client's list of workers while no worker joined or left)."""
    out = {}
    for addr, w in workers_info(client, cached).items():
        slots = [r for r in (w.get("resources") or {}) if r.startswith("slot")]
        if slots:
            out[addr] = slots[0]
    try:
        _SEEN.setdefault(client, set()).update(out.values())
    except TypeError:                       # not weak-referenceable (a stand-in client)
        pass
    return out


def seen_slots(client: Any) -> set[str]:
    """Every ``slot<i>`` this client's scheduler had while the client watched: the
    cluster's full size, so a stage whose slot is missing now (its worker was lost and is
    restarting, or scaled away) is known as lost rather than as never there."""
    try:
        return set(_SEEN.get(client, ()))
    except TypeError:
        return set()


def check_open(client: Any) -> None:
    """Raise `ClientClosedError` (with the fix) when `client` was closed."""
    status = getattr(client, "status", "running")
    if status in ("closing", "closed") or (status != "running"
                                           and getattr(client, "scheduler", 1) is None):
        raise ClientClosedError(
            f"the distributed Client {getattr(client, 'id', '')} is {status}: make a new one "
            "(client = distributed.Client(cluster)) and use it: a dd.Trainer keeps the client "
            "it was made with (make the Trainer again with client=client, and go on from "
            "trainer.init or dd.load); a step takes the current one (`with "
            "client.as_current():`); or compute without a client on local threads")


def workers_info(client: Any, cached: bool = False) -> dict[str, Any]:
    """Every worker's entry of the scheduler's identity, asked directly: the client's
    cached `scheduler_info()` is also refreshed by a periodic callback that lists no
    workers, which can overwrite it between the refresh and the read.

    `cached` (building a step): the answer kept from the last ask, while the scheduler
    announced no worker joining or leaving (dagdiff's scheduler plugin, `MEMBERSHIP_TOPIC`)
    and for at most `MEMBERSHIP_TTL` s: no round trip per step."""
    check_open(client)
    entry = _CACHE.get(client) if cached else None
    if entry is not None and time.monotonic() - entry[0] < MEMBERSHIP_TTL:
        return dict(entry[1])
    watching = _watch(client)
    if not getattr(client, "asynchronous", False):
        try:
            info = dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        except TypeError:                   # an older scheduler without n_workers
            info = dict(client.sync(client.scheduler.identity)["workers"])
    else:
        info = dict(client.scheduler_info()["workers"])
    if watching:
        try:
            _CACHE[client] = (time.monotonic(), info)
        except TypeError:                   # not weak-referenceable (a stand-in client)
            pass
    return dict(info)


def forget_workers(client: Any) -> None:
    """Drop `client`'s cached list of workers (the next build asks the scheduler)."""
    try:
        _CACHE.pop(client, None)
    except TypeError:
        pass


_CACHE: "weakref.WeakKeyDictionary[Any, tuple[float, dict[str, Any]]]" = \
    weakref.WeakKeyDictionary()
_WATCHED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_SEEN: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def _watch(client: Any) -> bool:
    """Subscribe `client` to its scheduler's membership announcements (once); False when
    the scheduler does not make them (dagdiff's plugins are not registered there)."""
    from ..runtime.plugins import MEMBERSHIP_TOPIC, is_registered

    try:
        if client in _WATCHED:
            return True
    except TypeError:
        return False
    if getattr(client, "asynchronous", False) or not is_registered(client):
        return False
    ref = weakref.ref(client)

    def changed(event: Any) -> Any:
        c = ref()
        if c is None:
            return None
        forget_workers(c)
        msg = event[1] if isinstance(event, tuple) and len(event) == 2 else event
        if not (isinstance(msg, dict) and msg.get("action") == "remove"):
            return None
        waits = [w for hook in list(_REMOVAL_HOOKS)
                 if inspect.isawaitable(w := hook(c, str(msg.get("worker"))))]
        return asyncio.gather(*waits, return_exceptions=True) if waits else None

    try:
        client.subscribe_topic(MEMBERSHIP_TOPIC, changed)
    except Exception:                       # noqa: BLE001 - no cache, ask every time
        return False
    _WATCHED.add(client)
    return True


_REMOVAL_HOOKS: list[Callable[[Any, str], Any]] = []


def on_worker_removed(hook: Callable[[Any, str], Any]) -> None:
    """Call ``hook(client, address)`` in a client's event loop whenever its scheduler
    removes a worker (as soon as the scheduler knows: `MEMBERSHIP_TOPIC`); it may return
    an awaitable. Registered once per hook."""
    if hook not in _REMOVAL_HOOKS:
        _REMOVAL_HOOKS.append(hook)


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
