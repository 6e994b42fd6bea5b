"""A client's inbox: where the programs of a step whose values the client takes at once
(`step.compute`) push their outputs, and a Trainer step's loss task its loss (to every
inbox open on its worker: `InboxEnds.push_all`), so the client has them as they are made
instead of after Dask's round trips (the scheduler hearing of the task's end, telling the client,
the client asking the scheduler to gather from the workers: 4-8 ms of a ~30 ms tiny step
on the project's 2-core machine).

The step stays a Dask computation: its program tasks return the same outputs, which Dask
holds, recovers and shows as always; the push is a copy sent on the side. The client
takes the pushed values when every one of the step's programs pushed before its futures
finished, and otherwise gathers them from Dask (a push lost, a worker without an inbox,
a failure: the futures say what happened).

The client opens one connection per worker with distributed's `connect` (the cluster's
`Security`, TLS included) and announces it with ``dagdiff_inbox``; both ends then take the
comm's socket from their event loops, as lanes do (`lanes`): the worker's end is an
`OutLane` its programs write to, the client's a reader thread. A connection opens in the
background the first time a step needs it (that step gathers as before), so a client that
cannot reach its workers (behind a proxy) loses nothing but the push. Only outputs up to
`lanes.INLINE_WRITE` bytes are pushed (written by the program itself before its task
ends); larger ones come through Dask. Dask config ``dagdiff.direct.push-outputs: false``
turns pushes off.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Collection, Iterable, Mapping

import dask
from distributed.comm import connect

from ..internals import DONT_REPLY, take_socket
from .lanes import ACK, close_reader, read_messages, resolve, shutdown

__all__ = ["INBOX_OP", "PUSH_KEY", "ClientInbox", "InboxEnds", "inbox_for", "pushes_enabled"]

log = logging.getLogger(__name__)

#: the worker handler a client's inbox connection is announced with
INBOX_OP = "dagdiff_inbox"
#: dask config key: False gathers every step's outputs through Dask
PUSH_KEY = "dagdiff.direct.push-outputs"
#: seconds before a worker the inbox could not reach is tried again
RETRY_AFTER = 60.0
#: seconds a connection may take to open
CONNECT_TIMEOUT = 10.0
#: seconds between checks that an inbox's client is still open
WATCH_EVERY = 1.0
#: seconds a step whose futures all finished still waits for its pushes
GRACE = 0.05
#: what a worker pushes for an output it does not send (too large): gather it
_REFUSED = object()
#: seconds a step whose outputs came by push keeps its futures for their tasks' ends
TRAIL_FOR = 5.0


def pushes_enabled() -> bool:
    """Whether steps push their outputs to the client (dask config `PUSH_KEY`)."""
    return bool(dask.config.get(PUSH_KEY, True))


class _Link:
    """The inbox's connection from one worker: opening, open (its socket, read by a
    thread) or failed (when)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.failed_at: float | None = None
        self.opening = True


class ClientInbox:
    """One client's inbox (`inbox_for`): its id, its connections, the outputs pushed to it.

    `expect` the keys of a step's pushing tasks before submitting it, then `take` them:
    the pushed values, or None when the futures finished first (gather them)."""

    def __init__(self, client: Any) -> None:
        self.id = uuid.uuid4().hex
        self._client = weakref.ref(client)
        self._cond = threading.Condition(threading.Lock())
        self._links: dict[str, _Link] = {}
        self._wanted: set[str] = set()
        self._values: dict[str, Any] = {}
        self._closed = False
        self._watching = False              # a thread closes the inbox with its client
        #: steps whose outputs came by push, and steps that gathered them instead
        self.pushed = self.gathered = 0
        #: futures of steps whose outputs came by push, held until their tasks end
        #: (`trail`): id -> (future, when to let go)
        self._trailing: dict[int, tuple[Any, float]] = {}

    # --- connections --------------------------------------------------------------------
    def ready(self, addresses: Iterable[str]) -> bool:
        """Whether every worker in `addresses` has an open connection; opens the missing
        ones in the background (tcp and tls; a failed one is tried again after
        `RETRY_AFTER` s)."""
        client = self._client()
        if client is None or self._closed or getattr(client, "status", "") != "running":
            return False
        missing = []
        with self._cond:
            for address in addresses:
                link = self._links.get(address)
                if link is not None and link.sock is not None:
                    continue
                if link is not None and (link.opening or (
                        link.failed_at is not None
                        and time.monotonic() - link.failed_at < RETRY_AFTER)):
                    return False
                if not address.startswith(("tcp://", "tls://")):
                    return False
                self._links[address] = _Link()
                missing.append(address)
        for address in missing:
            try:
                client.loop.add_callback(self._open, address)
            except RuntimeError:                        # the client's loop is closed
                self._failed(address)
        return not missing and bool(addresses)

    async def _open(self, address: str) -> None:
        client = self._client()
        comm = None
        try:
            if client is None:
                raise ConnectionError("the client is gone")
            comm = await connect(address, timeout=CONNECT_TIMEOUT, name="dagdiff-inbox",
                                 **client.connection_args)
            await comm.write({"op": INBOX_OP, "inbox": self.id, "reply": False})
            sock = await take_socket(comm)
            if sock is None:
                raise ConnectionError(f"the comm to {address} has no socket to take")
        except Exception as e:                          # noqa: BLE001 - push nothing there
            log.debug("dagdiff: no inbox connection from %s (%s: %s)", address,
                      type(e).__name__, e)
            if comm is not None:
                comm.abort()
            self._failed(address)
            return
        thread = threading.Thread(target=self._read, args=(address, sock, comm), daemon=True,
                                  name=f"dagdiff-inbox-from-{address}")
        thread.start()
        with self._cond:
            watch, self._watching = not self._watching, True
        if watch:
            threading.Thread(target=_watch, args=(weakref.ref(self),), daemon=True,
                             name="dagdiff-inbox-watch").start()

    def _read(self, address: str, sock: socket.socket, comm: Any) -> None:
        reader = None
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            if sock.recv(1) != ACK:
                raise ConnectionError(f"{address} did not take the inbox connection")
            sock.settimeout(None)
            with self._cond:
                link = self._links.get(address)
                if link is None or self._closed:
                    return
                link.sock, link.opening = sock, False
            reader = sock.makefile("rb", buffering=1 << 16)
            # a push that does not decode is lost: its step gathers from Dask
            read_messages(reader, True, self._received, f"{address} (inbox)")
        except (OSError, ValueError) as e:
            log.debug("dagdiff: inbox connection from %s ended (%s)", address, e)
        finally:
            close_reader(reader)
            shutdown(sock)
            sock.close()
            self._failed(address)
            client = self._client()
            if client is not None:
                try:
                    client.loop.add_callback(comm.abort)
                except RuntimeError:
                    pass

    def _failed(self, address: str) -> None:
        with self._cond:
            link = self._links.get(address)
            if link is not None:
                link.sock, link.opening, link.failed_at = None, False, time.monotonic()
            self._cond.notify_all()

    def close(self) -> None:
        """Close every connection (their reader threads end)."""
        with self._cond:
            self._closed = True
            socks = [link.sock for link in self._links.values() if link.sock is not None]
            self._cond.notify_all()
        for sock in socks:
            shutdown(sock)

    # --- outputs ------------------------------------------------------------------------
    def _received(self, msg: Any) -> None:
        if isinstance(msg, dict):
            self._deliver(str(msg.get("key")),
                          _REFUSED if msg.get("refused") else msg.get("value"))

    def _deliver(self, key: str, value: Any) -> None:
        with self._cond:
            if key in self._wanted:
                self._values[key] = value
                self._cond.notify_all()

    def expect(self, keys: Collection[str]) -> None:
        """Keep what is pushed under `keys` from now on (until `take`)."""
        with self._cond:
            self._wanted.update(keys)

    def take(self, keys: Collection[str], futures: Collection[Any],
             timeout: float | None = None) -> dict[str, Any] | None:
        """Wait until every key of `keys` was pushed: their values. None (gather them
        from Dask) when a worker said it would not push one (too large), when one of
        `futures` (the step's) failed or was cancelled, when they all finished and the
        pushes did not come within `GRACE` s (a push lost), or after `timeout` s."""
        wake = self._wake
        for f in futures:
            f.add_done_callback(wake)
        deadline: float | None = None
        give_up = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                while True:
                    if all(k in self._values for k in keys):
                        if any(self._values[k] is _REFUSED for k in keys):
                            break
                        self.pushed += 1
                        return {k: self._values[k] for k in keys}
                    if self._closed or any(f.done() and f.status != "finished"
                                           for f in futures):
                        break
                    wait = 1.0
                    if give_up is not None:
                        wait = give_up - time.monotonic()
                        if wait <= 0:
                            break
                    if all(f.done() for f in futures):
                        deadline = deadline or time.monotonic() + GRACE
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            break
                    self._cond.wait(wait)
                self.gathered += 1
                return None
        finally:
            self.forget(keys)

    def forget(self, keys: Collection[str]) -> None:
        """Stop keeping what is pushed under `keys` (and drop what was)."""
        with self._cond:
            self._wanted.difference_update(keys)
            for k in keys:
                self._values.pop(k, None)

    def _wake(self, _: Any = None) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- the tasks behind pushed values -------------------------------------------------
    def trail(self, futures: Iterable[Any]) -> None:
        """Hold `futures` (a step whose values came by push, before its tasks ended)
        until they finish, for at most `TRAIL_FOR` s: a future released while its task
        still runs makes the scheduler cancel it, so the task stream (`dd.record`, the
        dashboard) never hears of that program."""
        until = time.monotonic() + TRAIL_FOR
        with self._cond:
            self._let_go(time.monotonic())
            for f in futures:
                if not f.done():
                    self._trailing[id(f)] = (f, until)
                    f.add_done_callback(self._trailed)

    def _trailed(self, f: Any) -> None:
        with self._cond:
            self._trailing.pop(id(f), None)
            self._cond.notify_all()

    def _let_go(self, now: float) -> None:
        for k, (_, until) in list(self._trailing.items()):
            if until <= now:
                del self._trailing[k]

    def settle(self, timeout: float = TRAIL_FOR) -> bool:
        """Wait until the held futures (`trail`) finished, at most `timeout` s: True when
        they all did."""
        give_up = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                self._let_go(now)
                if not self._trailing:
                    return True
                if now >= give_up or self._closed:
                    return False
                self._cond.wait(min(give_up - now, 0.1))

    def stats(self) -> Mapping[str, int]:
        """Steps whose outputs came by push, and steps that gathered them."""
        with self._cond:
            return {"pushed": self.pushed, "gathered": self.gathered,
                    "open": sum(link.sock is not None for link in self._links.values())}


def _watch(ref: "weakref.ref[ClientInbox]") -> None:
    """Close an inbox once its client is closed or gone (checked every `WATCH_EVERY` s);
    the workers see the hang-up and drop their ends."""
    while True:
        time.sleep(WATCH_EVERY)
        box = ref()
        if box is None:
            return
        client = box._client()
        if box._closed or client is None or getattr(client, "status", "") in (
                "closing", "closed"):
            box.close()
            return
        del box, client


_INBOXES: "weakref.WeakKeyDictionary[Any, ClientInbox]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def inbox_for(client: Any, make: bool = True) -> ClientInbox | None:
    """`client`'s inbox (made once; closed when the client is collected), or None for a
    client that cannot have one (asynchronous, a stand-in), when pushes are off, or (not
    `make`) when it has none yet."""
    if not pushes_enabled() or getattr(client, "asynchronous", False) \
            or not hasattr(client, "connection_args"):
        return None
    with _LOCK:
        try:
            box = _INBOXES.get(client)
            if box is None and not make:
                return None
            if box is None:
                box = _INBOXES[client] = ClientInbox(client)
                weakref.finalize(client, box.close)
        except TypeError:                               # not weak-referenceable
            return None
    return box


class InboxEnds:
    """A worker's ends of its clients' inboxes (the ``dagdiff_inbox`` handler): `push`
    writes an output to one from the program's thread. The newest `KEEP` are kept."""

    KEEP = 64

    def __init__(self, worker: Any, write_timeout: float) -> None:
        self.worker = worker
        self._write_timeout = write_timeout
        self._lock = threading.Lock()
        #: inbox id -> (its socket, the lock its writers take, the comm, frames' context,
        #: the event loop and the future its handler waits on until the inbox closes)
        self._ends: dict[str, tuple[Any, ...]] = {}
        #: keys a program pushed already (`push_all(note=True)`), for their output task
        self._noted: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def accept(self, comm: Any, inbox: str = "") -> Any:
        """Handler of `INBOX_OP`: take the comm's socket and answer `ACK`."""
        sock = await take_socket(comm) if inbox else None
        if sock is None:
            comm.abort()                                # the client sees no ACK: it gathers
            return DONT_REPLY
        context = {"sender": comm.local_info, "recipient": comm.remote_info,
                   **comm.handshake_options}
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()
        # open here before the client hears so: a step it sends once it has every ACK
        # finds its inbox on every worker
        with self._lock:
            self._ends[inbox] = (sock, threading.Lock(), comm, context, loop, ended)
            while len(self._ends) > self.KEEP:
                self._drop(next(iter(self._ends)))
        try:
            sock.settimeout(self._write_timeout)
            sock.sendall(ACK)
        except OSError:
            with self._lock:
                if self._ends.get(inbox, (None,) * 6)[5] is ended:
                    del self._ends[inbox]
            comm.abort()
            return DONT_REPLY
        # the client never writes: the socket turning readable means it hung up
        fd = sock.fileno()
        loop.add_reader(fd, self._hung_up, inbox, ended)
        try:            # the handler holds the comm until the inbox closes: distributed
            await asyncio.shield(ended)     # would read it again once the handler returns
        finally:
            loop.remove_reader(fd)
            with self._lock:
                if self._ends.get(inbox, (None,) * 6)[5] is ended:
                    self._drop(inbox)
            shutdown(sock)
            comm.abort()
        return DONT_REPLY

    def _hung_up(self, inbox: str, ended: asyncio.Future) -> None:
        """The client closed inbox `inbox` (its socket turned readable): drop it."""
        with self._lock:
            if self._ends.get(inbox, (None,) * 6)[5] is ended:
                self._drop(inbox)
        resolve(ended)

    def open_inboxes(self) -> int:
        """How many clients' inboxes are open here."""
        with self._lock:
            return len(self._ends)

    def is_open(self, inbox: str) -> bool:
        """Whether the inbox with id `inbox` (`ClientInbox.id`) is open here."""
        with self._lock:
            return inbox in self._ends

    def push(self, inbox: str, key: str, value: Any, wait: bool = True) -> bool:
        """Write `value` (pushed under `key`) to the client's inbox `inbox`, now, if it is
        small (`INLINE_WRITE`) and the inbox is open here; False otherwise (the client
        gathers it). A failed write closes that inbox. `wait=False` (on the event loop):
        a write the socket cannot take at once fails (and closes the inbox) instead of
        blocking."""
        from dask.sizeof import sizeof
        from distributed.protocol import to_serialize

        from .lanes import INLINE_WRITE, encode, write_frames

        with self._lock:
            end = self._ends.get(inbox)
        if end is None:
            return False
        sock, lock, _, context = end[:4]
        pushed, frames = True, None
        if sizeof(value) <= INLINE_WRITE:               # else not even serialized
            try:
                frames = encode({"key": key, "value": to_serialize(value)}, context)
            except Exception as e:                      # noqa: BLE001 - Dask sends it
                log.debug("dagdiff: output %s not pushed (%s: %s)", key, type(e).__name__,
                          e)
        if frames is None or sum(memoryview(f).nbytes for f in frames) > INLINE_WRITE:
            # the client stops waiting for it at once and gathers it from Dask
            frames, pushed = encode({"key": key, "refused": True}, context), False
        if not lock.acquire(blocking=wait):
            return False                                # another write is under way
        try:
            if not wait:
                sock.settimeout(0.0)
            try:
                write_frames(sock, [frames])
            finally:
                if not wait:
                    sock.settimeout(self._write_timeout)
                lock.release()
        except OSError as e:
            log.debug("dagdiff: inbox %s closed (%s)", inbox, e)
            with self._lock:
                self._drop(inbox)
            return False
        return pushed

    def push_all(self, key: str, value: Any, note: bool = False) -> int:
        """`push` `value` to every inbox open here (whichever client waits for `key`
        takes it; the others drop it), never blocking (called on the event loop, or by a
        program that must not wait on a client): how many took it. `note`: remember that
        `key` went out (`pushed_before`), when any inbox took it."""
        with self._lock:
            inboxes = list(self._ends)
        took = sum(self.push(inbox, key, value, wait=False) for inbox in inboxes)
        if note and took:
            with self._lock:
                self._noted[key] = None
                while len(self._noted) > 4 * self.KEEP:
                    self._noted.popitem(last=False)
        return took

    def pushed_before(self, key: str) -> bool:
        """Whether a program pushed `key` already (`push_all(note=True)`); forgets it."""
        with self._lock:
            if key not in self._noted:
                return False
            del self._noted[key]
            return True

    def _drop(self, inbox: str) -> None:
        """Close inbox `inbox` here (call with the lock): its handler ends."""
        end = self._ends.pop(inbox, None)
        if end is not None:
            shutdown(end[0])
            try:
                end[4].call_soon_threadsafe(resolve, end[5])
            except RuntimeError:                        # the loop is closed
                pass

    def close(self) -> None:
        with self._lock:
            for inbox in list(self._ends):
                self._drop(inbox)
