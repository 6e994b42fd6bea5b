"""Worker-to-worker messages for direct dispatch, off the event loop: one listener per
worker process, one connection and sender thread per peer, values pickled.

Distributed's own RPC goes through each worker's event loop, which on a busy machine
adds milliseconds per message (measured 3-10 ms from send to receipt while a step's
tasks start). Here a program queues its value for the peer's sender thread (`post`) and
goes on with its next action while the value is converted, pickled (protocol 5, arrays
written out of band, straight from their memory) and written; a receiver thread on the
consumer's process delivers it to the waiting program.

Each listener has its own random key; a client proves it holds the key (HMAC-SHA256 of
a fresh challenge) before anything it sends is unpickled. Clients learn address and key
through Dask (`Client.run`), so only holders of the cluster's Dask connection can
connect. The accept loop only accepts: the challenge runs on the connection's own
thread, so a peer that connects and hangs up (a liveness probe, `reachable`) or never
answers cannot stop the listener, and every connect and challenge has a deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import queue
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from .errors import DagdiffError

__all__ = ["Endpoint", "ChannelError", "start", "endpoint", "send", "post", "reachable",
           "close_all"]

log = logging.getLogger(__name__)

#: (host, port, authkey) of a listener
Endpoint = tuple[str, int, bytes]

#: seconds a connect, the key challenge or a wait for a peer busy sending may take
CONNECT_TIMEOUT = 10.0
#: seconds a write may make no progress (a peer whose process stopped reading) before
#: the send fails
WRITE_TIMEOUT = 60.0
_HELLO = b"dagdiff-channel-1"
_NONCE = 32
_OK = b"ok"

_LOCK = threading.Lock()
_SERVER: dict[str, Any] = {}               # "socket", "endpoint", "handler"
_PEERS: dict[tuple[str, int], "_Peer"] = {}


class ChannelError(DagdiffError, ConnectionError):
    """A peer's listener could not be reached, refused our key, or is too busy."""


def start(host: str, handler: Callable[[dict[str, Any]], None]) -> Endpoint:
    """Start this process's listener on `host` (once; later calls return the same
    endpoint and replace the handler). `handler` runs on a receiver thread per message."""
    with _LOCK:
        _SERVER["handler"] = handler
        if "endpoint" in _SERVER:
            return _SERVER["endpoint"]
        key = os.urandom(32)
        sock = socket.create_server((host, 0), backlog=128)
        ep: Endpoint = (host, sock.getsockname()[1], key)
        _SERVER.update(socket=sock, endpoint=ep)
    threading.Thread(target=_accept, args=(sock, key), name="dagdiff-channel-accept",
                     daemon=True).start()
    return ep


def endpoint() -> Endpoint | None:
    """This process's listener endpoint, or None when none was started."""
    return _SERVER.get("endpoint")


def _accept(sock: socket.socket, key: bytes) -> None:
    """Accept connections until the listener is closed; each gets its own thread. Nothing
    a peer does ends this loop (a dead accept loop leaves a port that takes connections
    and never answers them)."""
    import time

    warned = 0.0
    while True:
        conn = None
        try:
            conn, _ = sock.accept()
            threading.Thread(target=_receive, args=(conn, key), name="dagdiff-channel-recv",
                             daemon=True).start()
        except Exception as e:
            if _SERVER.get("socket") is not sock:        # closed (`close_all`)
                return
            if conn is not None:
                conn.close()
            if time.monotonic() - warned > 10:
                warned = time.monotonic()
                log.warning("dagdiff channel: could not accept a connection (%s: %s); "
                            "still listening", type(e).__name__, e)
            time.sleep(0.05)                             # e.g. out of file descriptors


def _receive(sock: socket.socket, key: bytes) -> None:
    try:
        conn = _challenge(sock, key)
    except Exception as e:                   # a probe hung up, or a wrong key
        sock.close()
        if isinstance(e, ChannelError):
            log.warning("dagdiff channel: refused a connection (%s)", e)
        return
    with conn:
        while True:
            try:
                msg = _read(conn)
            except (EOFError, OSError):
                return
            except _Unreadable as e:         # tell the consumer, then drop the connection
                _handle(e.msg)
                return
            except Exception:
                log.exception("dagdiff channel: dropped a connection it could not read")
                return
            _handle(msg)


def _handle(msg: dict[str, Any]) -> None:
    try:
        _SERVER["handler"](msg)
    except Exception:
        log.exception("dagdiff channel: handler failed")


class _Unreadable(Exception):
    """A message whose envelope arrived but whose buffers could not be received."""

    def __init__(self, msg: dict[str, Any]) -> None:
        super().__init__(msg.get("error"))
        self.msg = msg


def _keepalive(sock: socket.socket) -> None:
    """Let the OS notice a peer host that vanished without closing (best effort)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    except OSError:
        pass


def _write_timeout(sock: socket.socket) -> None:
    """Writes that make no progress for `WRITE_TIMEOUT` fail (the socket stays blocking,
    as `Connection` needs; best effort where the OS has no SO_SNDTIMEO)."""
    import struct
    import sys

    if sys.platform == "win32":
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(WRITE_TIMEOUT), 0))
    except OSError:
        pass


def _challenge(sock: socket.socket, key: bytes) -> Connection:
    """Server side of the handshake: send a fresh nonce, expect its HMAC under our key."""
    sock.settimeout(CONNECT_TIMEOUT)
    peer = sock.getpeername()
    nonce = os.urandom(_NONCE)
    sock.sendall(_HELLO + nonce)
    answer = _recv_exactly(sock, 32)
    if not hmac.compare_digest(answer, hmac.new(key, nonce, hashlib.sha256).digest()):
        raise ChannelError(f"a peer at {peer} does not hold this listener's key")
    sock.sendall(_OK)
    sock.settimeout(None)
    _keepalive(sock)
    return Connection(sock.detach())


def _answer(sock: socket.socket, key: bytes, where: str) -> Connection:
    """Client side of the handshake (the socket has a timeout)."""
    hello = _recv_exactly(sock, len(_HELLO) + _NONCE)
    if not hello.startswith(_HELLO):
        raise ChannelError(f"{where} is not a dagdiff channel")
    sock.sendall(hmac.new(key, hello[len(_HELLO):], hashlib.sha256).digest())
    try:
        ok = _recv_exactly(sock, len(_OK))
    except EOFError:
        ok = b""
    if ok != _OK:
        raise ChannelError(f"{where} refused our key (a restarted worker has a new one)")
    sock.settimeout(None)
    _keepalive(sock)
    _write_timeout(sock)
    return Connection(sock.detach())


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the connection")
        buf += chunk
    return buf


def _connect(ep: Endpoint) -> Connection:
    where = f"{ep[0]}:{ep[1]}"
    try:
        sock = socket.create_connection((ep[0], ep[1]), timeout=CONNECT_TIMEOUT)
    except socket.timeout as e:
        raise ChannelError(f"connecting to {where} timed out after {CONNECT_TIMEOUT:g} s") from e
    try:
        return _answer(sock, ep[2], where)
    except socket.timeout as e:
        sock.close()
        raise ChannelError(f"{where} accepted but did not answer the key challenge within "
                           f"{CONNECT_TIMEOUT:g} s") from e
    except BaseException:
        sock.close()
        raise


def _write(conn: Connection, msg: dict[str, Any]) -> None:
    """One message: its envelope (everything but ``"value"``), then the value's pickle
    (protocol 5) with large buffers (NumPy arrays) out of band, each written straight
    from its memory, no copy into the pickle."""
    msg = dict(msg)
    value = msg.pop("value", None)
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    conn.send_bytes(pickle.dumps((msg, head, [v.nbytes for v in views]), protocol=5))
    for v in views:
        conn.send_bytes(v)


def _read(conn: Connection) -> dict[str, Any]:
    """Read what `_write` wrote; each buffer lands in its own writable bytearray. A value
    that does not unpickle here arrives as an error naming why (the stream goes on)."""
    msg, head, sizes = pickle.loads(conn.recv_bytes())
    bufs = []
    try:
        for n in sizes:
            buf = bytearray(n)
            if n:
                conn.recv_bytes_into(buf)
            else:
                conn.recv_bytes()
            bufs.append(buf)
    except MemoryError as e:
        bufs.clear()
        msg["value"] = None
        msg["error"] = (f"the value of {msg.get('key')} ({sum(sizes) / 2**20:.1f} MiB) could "
                        f"not be received: the receiving worker is out of memory ({e})")
        raise _Unreadable(msg) from e
    try:
        msg["value"] = pickle.loads(head, buffers=bufs)
    except Exception as e:
        msg["value"] = None
        if msg.get("error") is None:
            msg["error"] = (f"the value of {msg.get('key')} could not be unpickled on the "
                            f"receiving worker ({type(e).__name__}: {e}); is the same "
                            "software installed on every worker?")
    return msg


class _Peer:
    """A connection to one listener. `send` writes from the calling thread; `post`
    queues a message for this peer's sender thread (in order), so the caller goes on
    while the value is pickled and written. Neither blocks a caller for long: `post`
    only queues, and `send` gives up when the connection stays busy (another thread
    writing, connecting or stuck) for `CONNECT_TIMEOUT`. A write on a connection that
    broke since its last use is retried once on a new one (a repeated message replaces
    the first at the consumer); after a failed connect, sends fail at once for
    `CONNECT_TIMEOUT` instead of each waiting for their own connect to fail."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.lock = threading.Lock()         # the connection: one writer at a time
        self.conn: Connection | None = None
        self.down: tuple[float, str] | None = None   # (until, why) after a failed connect
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._drain, daemon=True,
                         name=f"dagdiff-channel-send-{ep[1]}").start()

    def send(self, msg: Any) -> None:
        if callable(msg):
            msg = msg()
        if not self.lock.acquire(timeout=CONNECT_TIMEOUT):
            raise ChannelError(f"{self.ep[0]}:{self.ep[1]}: the connection stayed busy for "
                               f"{CONNECT_TIMEOUT:g} s (is the peer's process stuck?)")
        try:
            reused = self.conn is not None
            try:
                self._connect_and_write(msg)
            except OSError:
                if not reused:
                    raise
                self._connect_and_write(msg)  # the peer may have dropped an idle connection
        finally:
            self.lock.release()

    def _connect_and_write(self, msg: Any) -> None:
        import time

        try:
            if self.conn is None:
                if self.down is not None and time.monotonic() < self.down[0]:
                    raise ChannelError(self.down[1])
                try:
                    self.conn = _connect(self.ep)
                except Exception as e:
                    self.down = (time.monotonic() + CONNECT_TIMEOUT,
                                 f"{self.ep[0]}:{self.ep[1]} could not be reached a moment "
                                 f"ago ({type(e).__name__}: {e})")
                    raise
                self.down = None
            _write(self.conn, msg)
        except BaseException:
            if self.conn is not None:
                self.conn.close()
            self.conn = None
            raise

    def post(self, msg: Any, done: Callable[[BaseException | None], None]) -> None:
        self.queue.put((msg, done))

    def stop(self) -> None:
        """End the sender thread (after what is queued) and close the connection."""
        self.queue.put(None)

    def _drain(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                with self.lock:
                    if self.conn is not None:
                        self.conn.close()
                        self.conn = None
                return
            msg, done = item
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
                if peer is not None:         # a restarted worker reusing the port
                    peer.stop()
                peer = _PEERS[key] = _Peer(ep)
    return peer


def send(ep: Endpoint, msg: Any) -> None:
    """Send `msg` to the listener at `ep` from the calling thread (pickling it here;
    raises if the peer cannot be reached, refuses the key, or its connection stays busy
    for `CONNECT_TIMEOUT`)."""
    _peer(ep).send(msg)


def post(ep: Endpoint, msg: Any, done: Callable[[BaseException | None], None]) -> None:
    """Queue `msg` (or a callable making it, run on the sender thread) for the listener
    at `ep`; messages to one peer go in order. `done(error)` runs on the sender thread
    once it was written (error None) or could not be."""
    _peer(ep).post(msg, done)


def reachable(ep: Endpoint, timeout: float = 5.0) -> bool | None:
    """Whether the listener at `ep` still serves: True when it answers a connect with
    its challenge (the connection is then dropped, nothing is sent); False when the
    connect is refused (nothing listens on that port: the process ended) or something
    else answers (the port was reused); None when it cannot tell (timed out: a busy or
    unreachable machine)."""
    try:
        with socket.create_connection((ep[0], ep[1]), timeout=timeout) as sock:
            return _recv_exactly(sock, len(_HELLO)) == _HELLO
    except ConnectionRefusedError:
        return False
    except (OSError, EOFError):
        return None


def close_all() -> None:
    """Close the listener (tests; worker processes simply exit)."""
    with _LOCK:
        sock = _SERVER.pop("socket", None)
        _SERVER.pop("endpoint", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        except OSError:
            pass
        sock.close()
