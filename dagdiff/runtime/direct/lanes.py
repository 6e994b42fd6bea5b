"""Lanes: direct-dispatch messages written and read by threads on the socket of a tcp or
tls comm that distributed opened, with no hop through either worker's event loop.

A lane is one-way. The sending worker opens a comm with distributed's `connect` (its
`Security`, TLS handshake and connection arguments all apply), announces it with the
``dagdiff_stream`` handler op and ``lane=True``; the receiver takes the comm's socket from
its event loop (`internals.take_socket`), answers one byte, and a reader thread of its
own reads the messages and hands each to the runtime; the sender, once it has the byte,
takes its end's socket the same way. From then on the sender's threads write to it: a
program writes a small message itself when nothing is queued ahead of it (the message is
on the wire when `send` returns), anything else goes through the lane's writer thread,
which also (re)connects. Messages keep their order per lane.

Measured on this project's 2-core machine, before lanes: a value took ~0.6 ms from one
idle worker to another over distributed's comm, of which the program handing it to the
event loop (~0.14 ms), the loops' reads and writes and the receiver's wake-up took most,
and each worker's event loop spent ~0.2 ms of CPU per message. The frames are those of
distributed's protocol (`distributed.protocol.dumps` / `loads`: Dask's serializers,
out-of-band buffers, the comm's compression); the framing is a count and the frames'
lengths. Backends without a socket of their own (inproc, UCX) and dask config
``dagdiff.direct.lanes: false`` use the comm itself (`transport._Pump`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
import threading
import time
from typing import Any, Callable

import dask
from distributed.comm import connect
from distributed.protocol import dumps, loads

from ..internals import take_socket


__all__ = ["LANES_KEY", "lanes_for", "OutLane", "open_lane", "accept_lane", "read_frames",
           "read_messages", "resolve", "close_reader",
           "write_frames", "encode", "shutdown", "send_failure", "tell", "ACK",
           "INLINE_WRITE"]

log = logging.getLogger(__name__)

#: dask config key: False sends every message through the comm on the event loop
LANES_KEY = "dagdiff.direct.lanes"
#: what the receiver answers once its reader thread owns the socket
ACK = b"\x01"
#: a program writes a message of up to this many bytes itself (a larger one is written by
#: the lane's writer thread while the program goes on)
INLINE_WRITE = 256 * 1024
#: frames up to this size are joined into one write and read from the reader's buffer;
#: larger ones are written and read on their own (no copy into a joined buffer)
_SMALL_FRAME = 64 * 1024
_COUNT = struct.Struct("<Q")

Done = Callable[[BaseException | None], None]


def lanes_for(address: str) -> bool:
    """Whether messages to `address` go on a lane (tcp and tls, unless config says no)."""
    return (address.startswith(("tcp://", "tls://"))
            and bool(dask.config.get(LANES_KEY, True)))


def encode(msg: Any, context: dict[str, Any]) -> list[Any]:
    """The frames of `msg` on a lane: distributed's protocol (raises if a value does not
    serialize, failing that message alone)."""
    return list(dumps(msg, on_error="raise", context=context))


def write_frames(sock: socket.socket, messages: list[list[Any]]) -> None:
    """Write messages (each a list of frames) in order: small ones joined in one write."""
    parts: list[Any] = []
    for frames in messages:
        lengths = [memoryview(f).nbytes for f in frames]
        parts.append(_COUNT.pack(len(frames)) + struct.pack(f"<{len(frames)}Q", *lengths))
        for f, n in zip(frames, lengths):
            if n > _SMALL_FRAME:
                if parts:
                    sock.sendall(b"".join(parts))
                    parts = []
                sock.sendall(f)
            else:
                parts.append(f)
    if parts:
        sock.sendall(b"".join(parts))


def read_frames(reader: Any) -> list[Any] | None:
    """One message's frames from a buffered reader of the socket (None at the end). Small
    frames are bytes, large ones writeable buffers of their own (their arrays are kept)."""
    head = reader.read(8)
    if len(head) < 8:
        return None
    (count,) = _COUNT.unpack(head)
    raw = reader.read(8 * count)
    if len(raw) < 8 * count:
        return None
    frames: list[Any] = []
    for n in struct.unpack(f"<{count}Q", raw):
        if n <= _SMALL_FRAME:
            f = reader.read(n)
            if len(f) < n:
                return None
            frames.append(f)
            continue
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = reader.readinto(view[got:])
            if not k:
                return None
            got += k
        frames.append(buf)
    return frames


def read_messages(reader: Any, deserialize: bool, on_message: Callable[[Any], None],
                  source: str) -> None:
    """Hand each message read from a buffered reader of a lane's socket to `on_message`
    (values deserialized or not) until the other end hangs up; a message that does not
    decode is logged and skipped. Raises OSError / ValueError when the socket fails."""
    while True:
        frames = read_frames(reader)
        if frames is None:
            return
        try:
            msg = loads(frames, deserialize=deserialize)
        except Exception as e:                      # noqa: BLE001 - a garbled message
            log.warning("dagdiff: dropped a message from %s (%s: %s)",
                        source, type(e).__name__, e)
            continue
        on_message(msg)


async def open_lane(worker: Any, address: str, timeout: float, op: str
                    ) -> tuple[Any, socket.socket, dict[str, Any]]:
    """Connect to `address` and announce a lane (on the event loop): (the comm, whose
    socket the caller now owns, the context its frames are encoded with). The caller
    waits for the receiver's `ACK` on the socket before writing."""
    comm = await connect(address, timeout=timeout, name="dagdiff-lane",
                         **worker.connection_args)
    try:
        await comm.write({"op": op, "reply": False, "lane": True})
        sock = await take_socket(comm)
    except BaseException:
        comm.abort()
        raise
    if sock is None:
        comm.abort()
        raise ConnectionError(f"the comm to {address} has no socket a lane can use")
    context = {"sender": comm.local_info, "recipient": comm.remote_info,
               **comm.handshake_options}
    return comm, sock, context


async def accept_lane(comm: Any, on_message: Callable[[Any], None],
                      sockets: set[socket.socket]) -> bool:
    """Receive a lane on `comm` (the ``dagdiff_stream`` handler, on the event loop): a
    reader thread hands each message (as `loads` gives it, values not deserialized) to
    `on_message` until the sender hangs up. False: this comm has no socket to take (the
    caller reads the comm itself). The socket is in `sockets` while the lane is open."""
    sock = await take_socket(comm)
    if sock is None:
        return False
    sockets.add(sock)
    loop = asyncio.get_running_loop()
    ended: asyncio.Future = loop.create_future()
    peer = comm.peer_address

    def read() -> None:
        # the reader (a file object of the socket) holds the descriptor open until it is
        # closed here, whoever closes the socket meanwhile: no read on a reused descriptor
        reader = None
        try:
            sock.sendall(ACK)
            reader = sock.makefile("rb", buffering=1 << 16)
            read_messages(reader, False, on_message, peer)
        except (OSError, ValueError):               # the lane closed (ValueError: its
            pass                                    # reader closed under it)
        finally:
            close_reader(reader)
            try:
                loop.call_soon_threadsafe(resolve, ended)
            except RuntimeError:                    # the worker's loop is closed
                pass

    thread = threading.Thread(target=read, name=f"dagdiff-lane-from-{peer}", daemon=True)
    thread.start()
    try:
        await asyncio.shield(ended)
    finally:                                        # the sender hung up, or the worker
        sockets.discard(sock)                       # closes (this handler is cancelled)
        shutdown(sock)                              # the reader's next read ends
        comm.abort()
    return True


def resolve(fut: asyncio.Future) -> None:
    """Set `fut`'s result (None) unless it is done (on its loop)."""
    if not fut.done():
        fut.set_result(None)


def close_reader(reader: Any) -> None:
    """Close a reader thread's file object of its socket (None: nothing to close)."""
    if reader is not None:
        try:
            reader.close()
        except OSError:
            pass


def shutdown(sock: socket.socket | None) -> None:
    """Shut a lane's socket down (its threads' reads and writes end at once)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class OutLane:
    """The sending end of the lane to one worker: its queue, its writer thread, its socket.
    `send` from any thread; each message's `done` is told, from the thread that wrote it,
    None once it was written or the error that stopped it."""

    def __init__(self, address: str, opener: Callable[[], tuple[Any, socket.socket,
                                                              dict[str, Any]]],
                 abort: Callable[[Any], None], on_loop: Callable[[], bool],
                 fail_fast_for: float, write_timeout: float, connect_timeout: float) -> None:
        self.address = address
        self._open = opener
        self._abort = abort
        self._on_loop = on_loop
        self._fail_fast_for = fail_fast_for
        self._write_timeout = write_timeout
        self._connect_timeout = connect_timeout
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[tuple[Any, Done]] = collections.deque()
        self._busy = False                      # a thread is writing to the socket
        self._comm: Any = None
        self._sock: socket.socket | None = None
        self._context: dict[str, Any] | None = None
        self._failed_at: float | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    # --- sending ------------------------------------------------------------------------
    def send(self, msg: Any, done: Done) -> None:
        """Write `msg` now (a program's small message, nothing ahead of it) or queue it."""
        with self._cond:
            error = self._refusal()
            sock = self._sock
            inline = (error is None and sock is not None and not self._busy
                      and not self._queue and not self._on_loop())
            if inline:
                self._busy = True
                context = self._context
            elif error is None:
                self._queue.append((msg, done))
                self._ensure_thread()
                self._cond.notify()
                return
        if error is not None:
            done(error)
            return
        try:
            frames = encode(msg, context or {})
        except Exception as e:                  # noqa: BLE001 - this message's own failure
            self._idle()
            done(e)
            return
        if sum(memoryview(f).nbytes for f in frames) > INLINE_WRITE:
            with self._cond:                    # large: the writer thread writes it
                self._busy = False
                self._queue.appendleft((frames, done))
                self._ensure_thread()
                self._cond.notify()
            return
        try:
            write_frames(sock, [frames])        # type: ignore[arg-type]
        except OSError:
            with self._cond:                    # the writer reconnects and writes it
                self._drop_socket()
                self._busy = False
                self._queue.appendleft((frames, done))
                self._ensure_thread()
                self._cond.notify()
            return
        self._idle()
        done(None)

    def _idle(self) -> None:
        with self._cond:
            self._busy = False
            if self._queue:
                self._cond.notify()

    def _refusal(self) -> BaseException | None:
        """Why a message cannot go now (call with the lock), or None."""
        if self._closed:
            return self._closed_error()
        if self._failed_at is not None:
            if time.monotonic() - self._failed_at < self._fail_fast_for:
                return self._error or ConnectionError(f"could not reach {self.address}")
            self._failed_at = self._error = None
        return None

    def _closed_error(self) -> ConnectionError:
        return ConnectionError(f"the lane to {self.address} is closed")

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._writer, daemon=True,
                                            name=f"dagdiff-lane-to-{self.address}")
            self._thread.start()

    # --- the writer thread --------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._busy) and not self._closed:
                    if not self._cond.wait(60.0) and not self._queue:
                        self._thread = None             # idle a minute: a new one later
                        return
                if self._closed:
                    batch = list(self._queue)
                    self._queue.clear()
                    break
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                self._write_batch(batch)
            finally:
                with self._cond:
                    self._busy = False
        err = self._closed_error()
        for _, done in batch:
            tell(done, err)

    def _write_batch(self, batch: list[tuple[Any, Done]]) -> None:
        """Write a batch (connecting first if needed; a broken lane is replaced once)."""
        error: BaseException | None = None
        for attempt in range(2):
            fresh = self._sock is None
            try:
                if fresh:
                    self._connect()
                ready: list[tuple[list[Any], Done]] = []
                for msg, done in batch:
                    if isinstance(msg, list):   # already frames
                        ready.append((msg, done))
                        continue
                    try:
                        ready.append((encode(msg, self._context or {}), done))
                    except Exception as e:      # noqa: BLE001 - this message's own failure
                        tell(done, e)
                batch = ready
                write_frames(self._sock, [f for f, _ in batch])  # type: ignore[arg-type]
                error = None
                break
            except Exception as e:              # noqa: BLE001 - connect or write
                error = e
                self._drop_socket()
                if fresh:
                    break
        if error is not None:
            error = send_failure(self.address, error, self._write_timeout,
                                 self._connect_timeout)
            with self._cond:
                self._failed_at, self._error = time.monotonic(), error
                batch += list(self._queue)
                self._queue.clear()
            log.warning("dagdiff: could not send %d message(s) to %s (%s: %s)",
                        len(batch), self.address, type(error).__name__, error)
        for _, done in batch:
            tell(done, error)

    def _connect(self) -> None:
        comm, sock, context = self._open()
        try:
            sock.settimeout(self._connect_timeout)
            reader = sock.recv(1)
            if reader != ACK:
                raise ConnectionError(f"{self.address} did not take the lane")
            sock.settimeout(self._write_timeout)
        except BaseException:
            shutdown(sock)
            self._abort(comm)
            raise
        with self._cond:
            self._comm, self._sock, self._context = comm, sock, context

    def _drop_socket(self) -> None:
        sock, comm = self._sock, self._comm
        self._sock = self._comm = None
        shutdown(sock)
        if comm is not None:
            self._abort(comm)

    def close(self) -> None:
        """Stop: queued messages fail, the socket is closed."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._drop_socket()
            self._cond.notify_all()
        err = self._closed_error()
        for _, done in queued:
            tell(done, err)


def send_failure(address: str, error: BaseException, write_timeout: float,
                 connect_timeout: float) -> BaseException:
    """What the senders of messages that could not be written to `address` are told: a
    timeout says which limits it ran into."""
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return TimeoutError(f"no progress writing to {address} within {write_timeout:g} s "
                            f"(or connecting within {connect_timeout:g} s)")
    return error


def tell(done: Done, error: BaseException | None) -> None:
    """Run a message's `done` (its own failure is logged, never raised)."""
    try:
        done(error)
    except Exception:                               # noqa: BLE001 - a callback's own failure
        log.exception("dagdiff: message callback failed")
