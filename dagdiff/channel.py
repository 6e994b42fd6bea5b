"""Worker-to-worker messages for direct dispatch, off the event loop: one listener per
worker process, one connection and sender thread per peer, values pickled.

Distributed's own RPC goes through each worker's event loop, which on a busy machine
adds milliseconds per message (measured 3-10 ms from send to receipt while a step's
tasks start). Here a program queues its value for the peer's sender thread (`post`) and
goes on with its next action while the value is converted, pickled (protocol 5, arrays
written out of band, straight from their memory) and written; a receiver thread on the
consumer's process delivers it to the waiting program. Each listener has its own random
key (HMAC challenge on connect, from `multiprocessing.connection`); clients learn
address and key through Dask (`Client.run`), so only holders of the cluster's Dask
connection can connect.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
from multiprocessing.connection import Client as _connect, Listener
from typing import Any, Callable

__all__ = ["Endpoint", "start", "endpoint", "send", "post", "reachable", "close_all"]

log = logging.getLogger(__name__)

#: (host, port, authkey) of a listener
Endpoint = tuple[str, int, bytes]

_LOCK = threading.Lock()
_SERVER: dict[str, Any] = {}               # "listener", "endpoint", "handler"
_PEERS: dict[tuple[str, int], "_Peer"] = {}


def start(host: str, handler: Callable[[dict[str, Any]], None]) -> Endpoint:
    """Start this process's listener on `host` (once; later calls return the same
    endpoint and replace the handler). `handler` runs on a receiver thread per message."""
    with _LOCK:
        _SERVER["handler"] = handler
        if "endpoint" in _SERVER:
            return _SERVER["endpoint"]
        key = os.urandom(16)
        listener = Listener((host, 0), authkey=key, backlog=64)
        ep: Endpoint = (host, listener.address[1], key)
        _SERVER.update(listener=listener, endpoint=ep)
    threading.Thread(target=_accept, args=(listener,), name="dagdiff-channel-accept",
                     daemon=True).start()
    return ep


def endpoint() -> Endpoint | None:
    """This process's listener endpoint, or None when none was started."""
    return _SERVER.get("endpoint")


def _accept(listener: Listener) -> None:
    while True:
        try:
            conn = listener.accept()
        except OSError:                      # listener closed
            return
        except (EOFError, ConnectionError):  # a liveness probe (`reachable`)
            continue
        except Exception as e:               # a peer failed the key challenge
            log.warning("dagdiff channel: refused a connection (%s)", e)
            continue
        threading.Thread(target=_receive, args=(conn,), name="dagdiff-channel-recv",
                         daemon=True).start()


def _receive(conn: Any) -> None:
    with conn:
        while True:
            try:
                msg = _read(conn)
            except (EOFError, OSError):
                return
            except Exception as e:           # a value that does not unpickle here
                log.error("dagdiff channel: dropped a message (%s: %s)", type(e).__name__, e)
                continue
            try:
                _SERVER["handler"](msg)
            except Exception:
                log.exception("dagdiff channel: handler failed")


def _write(conn: Any, msg: Any) -> None:
    """One message: its pickle (protocol 5) with large buffers (NumPy arrays) out of
    band, each written straight from its memory, no copy into the pickle."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    conn.send_bytes(pickle.dumps((head, [v.nbytes for v in views]), protocol=5))
    for v in views:
        conn.send_bytes(v)


def _read(conn: Any) -> Any:
    """Read what `_write` wrote; each buffer lands in its own writable bytearray."""
    head, sizes = pickle.loads(conn.recv_bytes())
    bufs = []
    for n in sizes:
        buf = bytearray(n)
        if n:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        bufs.append(buf)
    return pickle.loads(head, buffers=bufs)


class _Peer:
    """A connection to one listener. `send` writes from the calling thread; `post`
    queues a message for this peer's sender thread (in order), so the caller goes on
    while the value is pickled and written."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.lock = threading.Lock()
        self.conn: Any = None
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def send(self, msg: Any) -> None:
        if callable(msg):
            msg = msg()
        with self.lock:
            try:
                if self.conn is None:
                    self.conn = _connect((self.ep[0], self.ep[1]), authkey=self.ep[2])
                _write(self.conn, msg)
            except Exception:
                self.conn = None
                raise

    def post(self, msg: Any, done: Callable[[BaseException | None], None]) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._drain, daemon=True,
                                               name=f"dagdiff-channel-send-{self.ep[1]}")
                self.thread.start()
        self.queue.put((msg, done))

    def _drain(self) -> None:
        while True:
            msg, done = self.queue.get()
            error: BaseException | None = None
            try:
                self.send(msg)
            except BaseException as e:       # reported to the poster, never raised here
                error = e
            try:
                done(error)
            except Exception:
                log.exception("dagdiff channel: send callback failed")


def _peer(ep: Endpoint) -> _Peer:
    key = (ep[0], ep[1])
    peer = _PEERS.get(key)
    if peer is None or peer.ep != ep:
        with _LOCK:
            peer = _PEERS.get(key)
            if peer is None or peer.ep != ep:
                peer = _PEERS[key] = _Peer(ep)
    return peer


def send(ep: Endpoint, msg: Any) -> None:
    """Send `msg` to the listener at `ep` from the calling thread (pickling it here;
    raises if the peer cannot be reached)."""
    _peer(ep).send(msg)


def post(ep: Endpoint, msg: Any, done: Callable[[BaseException | None], None]) -> None:
    """Queue `msg` (or a callable making it, run on the sender thread) for the listener
    at `ep`; messages to one peer go in order. `done(error)` runs on the sender thread
    once it was written (error None) or could not be."""
    _peer(ep).post(msg, done)


def reachable(ep: Endpoint, timeout: float = 5.0) -> bool | None:
    """Whether a listener still runs at `ep`: True when a TCP connect succeeds (closed at
    once, without a message), False only when it is refused (nothing listens on that
    port: the process ended), None when it cannot tell (timed out, e.g. a busy or
    unreachable machine)."""
    import socket

    try:
        with socket.create_connection((ep[0], ep[1]), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def close_all() -> None:
    """Close the listener (tests; worker processes simply exit)."""
    with _LOCK:
        listener = _SERVER.pop("listener", None)
        _SERVER.pop("endpoint", None)
    if listener is not None:
        listener.close()
