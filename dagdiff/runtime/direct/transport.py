"""Ordered worker-to-worker message streams for direct dispatch, over distributed's comms.

Each worker opens one comm per peer it sends to (`distributed.comm.connect` with the
worker's own connection arguments: the cluster's `Security` (TLS), its comm backend
(tcp, tls, inproc, UCX) and Dask's serializers all apply) and announces it with the
handler op ``dagdiff_stream``, which dagdiff's worker extension registers on every
worker (as distributed's P2P shuffle registers its handlers). No socket is opened that
Dask does not own. Messages to one peer are written in order on that comm, several at a
time when they queue up; the receiver reads them in order and hands them over one by
one. A program queues its messages from its own thread (`Transport.send`) and goes on;
the worker's event loop writes them.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable

from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.protocol import Serialize, Serialized

from ..internals import DONT_REPLY, inline_writes, merge_and_deserialize, raw_comm
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
    `deliver` on the event loop, in each sender's order."""

    def __init__(self, worker: Any, deliver: Callable[[Message | DecodeError], None],
                 ) -> None:
        self.worker = worker
        self.deliver = deliver
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        worker.handlers[STREAM_OP] = self._accept

    # --- sending ------------------------------------------------------------------------
    def send(self, address: str, msg: Message, done: Done) -> None:
        """Queue `msg` for the worker at `address` (thread-safe, returns at once); `done`
        runs on the event loop once it was written (None) or could not be (the error)."""
        wire = to_wire(msg)
        self.worker.loop.add_callback(self._enqueue, address, wire, done)

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
                if isinstance(error, asyncio.TimeoutError):
                    error = TimeoutError(f"no progress writing to {peer.address} within "
                                         f"{WRITE_TIMEOUT:g} s (or connecting within "
                                         f"{CONNECT_TIMEOUT:g} s)")
                peer.failed_at, peer.error = time.monotonic(), error
                batch += list(peer.queue)
                peer.queue.clear()
                log.warning("dagdiff: could not send %d message(s) to %s (%s: %s)",
                            len(batch), peer.address, type(error).__name__, error)
            for _, done in batch:
                try:
                    done(error)
                except Exception:               # noqa: BLE001 - a callback's own failure
                    log.exception("dagdiff: message callback failed")
            if peer.queue:
                continue
            await asyncio.sleep(0)              # let senders on this loop queue more

    # --- receiving ----------------------------------------------------------------------
    async def _accept(self, comm: Any) -> Any:
        """Handler of ``dagdiff_stream``: read the peer's messages until it hangs up.
        Values are deserialized one by one, so one that fails becomes an error for its
        key and the stream goes on."""
        raw_comm(comm)
        while not comm.closed():
            try:
                msgs = await comm.read()
            except (CommClosedError, OSError):
                break
            for d in msgs if isinstance(msgs, (list, tuple)) else [msgs]:
                named = (d.get("run"), d.get("key")) if isinstance(d, dict) else (None, None)
                try:
                    msg: Message | DecodeError = from_wire(_decoded(d))
                except DecodeError as e:
                    msg = e
                except Exception as e:          # noqa: BLE001 - a malformed message
                    if None in named:
                        log.warning("dagdiff: dropped a message from %s (%s: %s)",
                                    comm.peer_address, type(e).__name__, e)
                        continue
                    # a value that cannot be rebuilt here: its consumer fails now, naming
                    # it, instead of waiting for it until the step's timeout
                    msg = DecodeError(*named, f"{type(e).__name__}: {e}")
                try:
                    self.deliver(msg)
                except Exception:               # noqa: BLE001 - never stop the stream
                    log.exception("dagdiff: delivering a message failed")
        return DONT_REPLY

    def close(self) -> None:
        """Stop sending: queued messages fail, comms are closed."""
        self._closed = True
        for peer in self._peers.values():
            for _, done in list(peer.queue):
                done(ConnectionError(f"{self.worker.address} is closing"))
            peer.queue.clear()
            if peer.comm is not None:
                peer.comm.abort()


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
