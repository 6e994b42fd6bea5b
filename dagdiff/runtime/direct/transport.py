"""Ordered worker-to-worker message streams for direct dispatch, over distributed's comms.

Each worker opens one comm per peer it sends to (`distributed.comm.connect` with the
worker's own connection arguments: the cluster's `Security` (TLS), its comm backend
(tcp, tls, inproc, UCX) and Dask's serializers all apply) and announces it with the
handler op ``dagdiff_stream``, which dagdiff's worker extension registers on every
worker (as distributed's P2P shuffle registers its handlers). No socket is opened that
Dask does not own. On tcp and tls the comm's socket then becomes a *lane* (`lanes`):
threads write and read it, a program's small message is on the wire when `send`
returns, and the receiver's reader thread hands it over, without either event loop.
On other backends (and with dask config ``dagdiff.direct.lanes: false``) messages to one
peer are written in order on that comm by the worker's event loop, several at a time when
they queue up, and the receiver reads them there. Either way a peer's messages arrive in
the order they were sent, and a value that cannot be rebuilt arrives as an error for its
key.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from typing import Any, Callable

from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.protocol import Serialize, Serialized

from ..internals import DONT_REPLY, inline_writes, merge_and_deserialize, raw_comm
from .lanes import (OutLane, accept_lane, lanes_for, open_lane, send_failure, shutdown,
                    tell)
from .messages import Message, from_wire, to_wire


__all__ = ["Transport", "STREAM_OP", "STATUS_OP", "CONNECT_TIMEOUT", "WRITE_TIMEOUT",
           "DecodeError"]

log = logging.getLogger(__name__)

STREAM_OP = "dagdiff_stream"
STATUS_OP = "dagdiff_status"
#: seconds a connect (with its handshake) may take
CONNECT_TIMEOUT = 10.0
#: seconds one write may take (a peer whose process stopped reading)
WRITE_TIMEOUT = 60.0
#: seconds after a failed connect during which messages to that worker fail at once
FAIL_FAST_FOR = 10.0

Done = Callable[[BaseException | None], None]


class DecodeError(Exception):
    """A received value could not be deserialized here."""


class _Peer:
    """The stream to one other worker: messages waiting to be written, and its comm."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.queue: collections.deque[tuple[dict[str, Any], Done]] = collections.deque()
        self.comm: Any = None
        self.task: Any = None
        self.failed_at: float | None = None
        self.error: BaseException | None = None


class Transport:
    """One worker's message streams: `send` from any thread, received messages handed to
    `deliver` (from a lane's reader thread, or on the event loop), in each sender's
    order. `deliver` must be thread-safe."""

    def __init__(self, worker: Any, deliver: Callable[[Message | DecodeError], None],
                 ) -> None:
        self.worker = worker
        self.deliver = deliver
        self._peers: dict[str, _Peer] = {}
        self._lanes: dict[str, OutLane] = {}
        self._lanes_lock = threading.Lock()
        self._in_sockets: set[socket.socket] = set()
        self._closed = False
        worker.handlers[STREAM_OP] = self._accept

    # --- sending ------------------------------------------------------------------------
    def send(self, address: str, msg: Message, done: Done) -> None:
        """Send `msg` to the worker at `address` (thread-safe; a program's small message on
        a lane is written before this returns, others are queued); `done` is told, from
        whichever thread wrote it (this one, a lane's writer, the event loop), None once it
        was written or the error that stopped it."""
        wire = to_wire(msg)
        if lanes_for(address):
            self._lane(address).send(wire, done)
            return
        self.worker.loop.add_callback(self._enqueue, address, wire, done)

    def _lane(self, address: str) -> OutLane:
        lane = self._lanes.get(address)
        if lane is not None:
            return lane
        with self._lanes_lock:
            lane = self._lanes.get(address)
            if lane is None:
                lane = self._lanes[address] = OutLane(
                    address, lambda: self._open_lane(address), self._abort_comm, _on_loop,
                    FAIL_FAST_FOR, WRITE_TIMEOUT, CONNECT_TIMEOUT)
                if self._closed:
                    lane.close()
            return lane

    def forget(self, address: str) -> None:
        """The worker at `address` left the cluster: close the lane to it (its queued
        messages fail; a later send to that address opens a new one)."""
        with self._lanes_lock:
            lane = self._lanes.pop(address, None)
        if lane is not None:
            lane.close()

    def _open_lane(self, address: str) -> Any:
        """Open a lane to `address` from a lane's writer thread (the connect runs on the
        event loop)."""
        loop = self.worker.loop.asyncio_loop
        fut = asyncio.run_coroutine_threadsafe(
            open_lane(self.worker, address, CONNECT_TIMEOUT, STREAM_OP), loop)
        try:
            return fut.result(CONNECT_TIMEOUT + 5)
        except BaseException:
            # given up (the event loop was too busy to connect in time): stop the connect,
            # or close the lane it opened meanwhile (no comm left for the GC to find open)
            if not fut.cancel() and not fut.cancelled() and fut.exception() is None:
                comm, sock, _ = fut.result()
                shutdown(sock)
                self._abort_comm(comm)
            raise

    def _abort_comm(self, comm: Any) -> None:
        try:
            self.worker.loop.add_callback(comm.abort)
        except RuntimeError:                     # the loop is closed: so is the socket
            pass

    def _enqueue(self, address: str, wire: dict[str, Any], done: Done) -> None:
        if self._closed:
            done(ConnectionError(f"{self.worker.address} is closing"))
            return
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer(address)
        if peer.failed_at is not None:
            if time.monotonic() - peer.failed_at < FAIL_FAST_FOR:
                done(peer.error or ConnectionError(f"could not reach {address}"))
                return
            peer.failed_at = peer.error = None
        peer.queue.append((wire, done))
        if peer.task is None or peer.task.done():
            peer.task = asyncio.ensure_future(self._pump(peer))

    async def _connect(self, address: str) -> Any:
        comm = await connect(address, timeout=CONNECT_TIMEOUT, name="dagdiff-direct",
                             **self.worker.connection_args)
        await comm.write({"op": STREAM_OP, "reply": False})
        return inline_writes(comm)

    async def _pump(self, peer: _Peer) -> None:
        """Write `peer`'s queued messages in order, in batches, until the queue stays
        empty; a broken comm is replaced once before its messages fail."""
        while peer.queue:
            batch = list(peer.queue)
            peer.queue.clear()
            error: BaseException | None = None
            for attempt in range(2):
                fresh = peer.comm is None or peer.comm.closed()
                try:
                    if fresh:
                        peer.comm = await asyncio.wait_for(self._connect(peer.address),
                                                           CONNECT_TIMEOUT + 1)
                    await _write(peer.comm, [w for w, _ in batch])
                    error = None
                    break
                except Exception as e:          # noqa: BLE001 - reported to each sender
                    error = e
                    if not _broken(e) and peer.comm is not None and not peer.comm.closed():
                        break                     # the batch did not serialize: comm is fine
                    if peer.comm is not None:
                        peer.comm.abort()
                    peer.comm = None
                    if fresh:                     # a new comm failed: no second try
                        break
            if error is not None and _broken(error):
                error = send_failure(peer.address, error, WRITE_TIMEOUT, CONNECT_TIMEOUT)
                peer.failed_at, peer.error = time.monotonic(), error
                batch += list(peer.queue)
                peer.queue.clear()
                log.warning("dagdiff: could not send %d message(s) to %s (%s: %s)",
                            len(batch), peer.address, type(error).__name__, error)
            for _, done in batch:
                tell(done, error)
            if peer.queue:
                continue
            await asyncio.sleep(0)              # let senders on this loop queue more

    # --- receiving ----------------------------------------------------------------------
    async def _accept(self, comm: Any, lane: bool = False) -> Any:
        """Handler of ``dagdiff_stream``: read the peer's messages until it hangs up (on a
        lane: its reader thread reads them). Values are deserialized one by one, so one
        that fails becomes an error for its key and the stream goes on."""
        raw_comm(comm)
        peer = comm.peer_address
        if lane:
            if not await accept_lane(comm, lambda msgs: self._received(msgs, peer),
                                     self._in_sockets):
                comm.abort()                    # the sender sees no ACK: it fails
            return DONT_REPLY
        while not comm.closed():
            try:
                msgs = await comm.read()
            except (CommClosedError, OSError):
                break
            self._received(msgs, peer)
        return DONT_REPLY

    def _received(self, msgs: Any, peer: str) -> None:
        """Hand each message read from `peer` to `deliver` (any thread)."""
        for d in msgs if isinstance(msgs, (list, tuple)) else [msgs]:
            named = (d.get("run"), d.get("key")) if isinstance(d, dict) else (None, None)
            try:
                msg: Message | DecodeError = from_wire(_decoded(d))
            except DecodeError as e:
                msg = e
            except Exception as e:          # noqa: BLE001 - a malformed message
                if None in named:
                    log.warning("dagdiff: dropped a message from %s (%s: %s)",
                                peer, type(e).__name__, e)
                    continue
                # a value that cannot be rebuilt here: its consumer fails now, naming
                # it, instead of waiting for it until the step's timeout
                msg = DecodeError(*named, f"{type(e).__name__}: {e}")
            try:
                self.deliver(msg)
            except Exception:               # noqa: BLE001 - never stop the stream
                log.exception("dagdiff: delivering a message failed")

    def close(self) -> None:
        """Stop sending and receiving: queued messages fail, comms and lanes are closed."""
        self._closed = True
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.close()
        for sock in list(self._in_sockets):
            shutdown(sock)
        for peer in self._peers.values():
            for _, done in list(peer.queue):
                done(ConnectionError(f"{self.worker.address} is closing"))
            peer.queue.clear()
            if peer.comm is not None:
                peer.comm.abort()


def _on_loop() -> bool:
    """Whether the calling thread runs an event loop (it does not block on a socket)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_timeout = getattr(asyncio, "timeout", None)       # Python >= 3.11


async def _write(comm: Any, msgs: list[dict[str, Any]]) -> None:
    """`comm.write(msgs)` within `WRITE_TIMEOUT` (``asyncio.timeout`` where it exists:
    no task per write, unlike ``asyncio.wait_for`` before Python 3.12)."""
    if _timeout is None:
        await asyncio.wait_for(comm.write(msgs), WRITE_TIMEOUT)
        return
    async with _timeout(WRITE_TIMEOUT):
        await comm.write(msgs)


def _broken(e: BaseException) -> bool:
    """Whether a failed write means the connection is unusable (as opposed to a message
    that could not be serialized, which fails only its own senders)."""
    return isinstance(e, (OSError, CommClosedError, asyncio.TimeoutError, TimeoutError))


def _decoded(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with every serialized leaf of its value deserialized (DecodeError, naming the
    run and key, for one that cannot be)."""
    if d.get("kind") != "value":
        return d
    try:
        d["value"] = _walk(d["value"])
    except Exception as e:                      # noqa: BLE001 - MemoryError, unpickling
        raise DecodeError(d.get("run"), d.get("key"), f"{type(e).__name__}: {e}") from e
    return d


def _walk(x: Any) -> Any:
    if isinstance(x, Serialize):
        return x.data
    if isinstance(x, Serialized):
        return merge_and_deserialize(x.header, x.frames)
    if isinstance(x, dict):
        return {k: _walk(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):           # msgpack may read lists as tuples
        return [_walk(v) for v in x]
    return x
