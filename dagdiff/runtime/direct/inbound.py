"""The receiving ends of a worker's lanes, read by whichever thread leads: a program that
waits for a value reads the sockets itself, else one background thread does.

A value's hop from one idle worker to another used to end with two thread wake-ups: the
lane's reader thread woke on the socket, then woke the waiting program through its
condition. On this project's 2-core machine the second wake-up cost ~60-100 us of a
~250-400 us hop. Here the waiting program polls every inbound lane itself (`Inbound.pump`)
and reads what arrives, handing each message on as the reader thread did (other runs'
messages too: their programs are notified as before); the kernel wakes the one thread that
needs the value.

One thread leads at a time (the lead is a lock): a program waiting while another leads
follows (waits on its condition, as before: the leader delivers to it) and is woken when
the lead is free. While no program runs on the worker, the background thread leads, so
messages for runs that have not started here and a lane's end are read as they come.
While programs run (`claimed`) and none of them waits, the background thread drains the
lanes every `_PARKED` s, so a sender is never stuck on a full socket behind a program that
computes. Every inbound lane is drained by whoever leads (a program waiting for one peer
reads the others too).

Sockets are non-blocking and each lane parses its messages incrementally (`InLane.pump`
reads what the socket has and keeps a message that is not whole for the next time): a
leader never blocks on one lane's half-sent message, so it stays free to see the others
and to be woken (`kick`). A lane whose bytes make no sense, or whose peer hangs up, is
dropped; the sender opens a new one.

A lane's socket came from a comm distributed opened (`lanes.accept_lane`); its messages
are framed as `lanes.write_frames` writes them.
"""
from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
from typing import Any, Callable, Iterator

from distributed.protocol import loads


__all__ = ["Inbound", "InLane", "PROGRAM_READS_KEY", "FOLLOW_SLICE"]

log = logging.getLogger(__name__)

#: dask config key: False leaves every read to the background thread (no program reads)
PROGRAM_READS_KEY = "dagdiff.direct.program-reads"
#: seconds a follower waits before it tries to lead again (it is also woken when the
#: lead is given up, and by every message for it)
FOLLOW_SLICE = 0.005
#: seconds between the background thread's drains of the lanes while programs run
_PARKED = 0.01
#: frames up to this size are read through the lane's buffer; larger ones into their own
_SMALL_FRAME = 64 * 1024
_CHUNK = 256 * 1024
#: bytes one lane reads per turn before the leader looks at the others
_TURN = 4 * 1024 * 1024
#: a message of more frames, or a frame larger, is taken for garbage (the lane is dropped)
_MAX_FRAMES = 1 << 20
_MAX_FRAME = 1 << 40
_COUNT = struct.Struct("<Q")
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError)


class _Ended(Exception):
    """The lane's peer hung up."""


class InLane:
    """One inbound lane: its non-blocking socket (read only by the thread that leads), the
    bytes read ahead, the message being read, and what to do with each message."""

    def __init__(self, sock: socket.socket, peer: str,
                 on_message: Callable[[Any], None], ended: Callable[[], None]) -> None:
        self.sock = sock
        self.peer = peer
        # a file object of the socket holds its descriptor open until it is closed here,
        # whoever closes the socket meanwhile: no read on a reused descriptor
        self._hold = sock.makefile("rb", buffering=0)
        self.fd = sock.fileno()
        self._on_message = on_message
        self._ended = ended
        self._buf = bytearray()
        self._pos = 0
        self._scratch = memoryview(bytearray(_CHUNK))
        self._lengths: tuple[int, ...] | None = None     # the message being read
        self._frames: list[Any] = []
        self._big: bytearray | None = None               # its large frame being filled
        self._big_have = 0
        self._ssl = isinstance(sock, ssl.SSLSocket)
        self.closed = False

    def ready(self) -> bool:
        """Whether bytes can be read that the socket's poll does not show (TLS holds
        decrypted bytes)."""
        return self._ssl and self.sock.pending() > 0    # type: ignore[attr-defined]

    # --- reading (the leading thread only) --------------------------------------------
    def pump(self) -> bool:
        """Read what the socket has now (up to `_TURN` bytes, without waiting) and hand on
        every message that is whole; False once the lane ended, broke or sent garbage
        (it is dropped then)."""
        try:
            budget = _TURN
            while True:
                self._parse()
                if budget <= 0:
                    return True
                got = self._recv()
                if got is None:
                    return True
                budget -= got
        except _Ended:
            return False
        except Exception as e:                   # noqa: BLE001 - reset, garbage, no memory
            if not isinstance(e, OSError):
                log.warning("dagdiff: dropped the lane from %s (%s: %s)", self.peer,
                            type(e).__name__, e)
            return False

    def _recv(self) -> int | None:
        """Read once into the large frame being filled or the buffer: the byte count,
        None if the socket has nothing now."""
        if self._big is not None:
            view = memoryview(self._big)[self._big_have:]
        else:
            view = self._scratch
        try:
            k = self.sock.recv_into(view)
        except _WOULD_BLOCK:
            return None
        if not k:
            raise _Ended
        if self._big is not None:
            self._big_have += k
        else:
            if self._pos and self._pos >= len(self._buf) // 2:
                del self._buf[:self._pos]
                self._pos = 0
            self._buf += self._scratch[:k]
        return k

    def _parse(self) -> None:
        """Advance the message being read with the bytes at hand; hand on each one that
        is whole."""
        while True:
            if self._big is not None:
                if self._big_have < len(self._big):
                    return
                self._frames.append(self._big)
                self._big = None
            elif self._lengths is None:
                have = len(self._buf) - self._pos
                if have < 8:
                    return
                (count,) = _COUNT.unpack_from(self._buf, self._pos)
                if count > _MAX_FRAMES:
                    raise ValueError(f"a message of {count} frames")
                if have < 8 + 8 * count:
                    return
                lengths = struct.unpack_from(f"<{count}Q", self._buf, self._pos + 8)
                if any(n > _MAX_FRAME for n in lengths):
                    raise ValueError(f"a frame of {max(lengths)} bytes")
                self._pos += 8 + 8 * count
                self._lengths, self._frames = lengths, []
            elif len(self._frames) < len(self._lengths):
                n = self._lengths[len(self._frames)]
                have = len(self._buf) - self._pos
                if n <= _SMALL_FRAME:
                    if have < n:
                        return
                    self._frames.append(bytes(self._buf[self._pos:self._pos + n]))
                    self._pos += n
                else:                            # its own buffer: what is here, then recv
                    big = bytearray(n)
                    take = min(have, n)
                    big[:take] = self._buf[self._pos:self._pos + take]
                    self._pos += take
                    self._big, self._big_have = big, take
                    continue
            if self._lengths is not None and len(self._frames) == len(self._lengths):
                frames, self._lengths, self._frames = self._frames, None, []
                self._deliver(frames)

    def _deliver(self, frames: list[Any]) -> None:
        try:
            msg = loads(frames, deserialize=False)
        except Exception as e:                   # noqa: BLE001 - a garbled message
            log.warning("dagdiff: dropped a message from %s (%s: %s)",
                        self.peer, type(e).__name__, e)
            return
        try:
            self._on_message(msg)
        except Exception:                        # noqa: BLE001 - never stop the lane
            log.exception("dagdiff: delivering a message from %s failed", self.peer)

    def close(self) -> None:
        """The lane ended: let go of its descriptor and tell its handler."""
        if self.closed:
            return
        self.closed = True
        try:
            self._hold.close()
        except OSError:
            pass
        try:
            self._ended()
        except Exception:                         # noqa: BLE001 - the loop may be closed
            pass


class Inbound:
    """A worker's inbound lanes and the one thread at a time that reads them."""

    def __init__(self) -> None:
        self._lead = threading.Lock()
        self._mutex = threading.Lock()
        self._lanes: dict[int, InLane] = {}
        self._followers: set[Any] = set()         # conditions of threads waiting to lead
        self._claims = 0
        self._parked = threading.Condition(self._mutex)
        self._background_leads = False
        # the wake pipe: a socket pair, closed when this object goes (never while a thread
        # could still write to a reused descriptor); only the thread that leads drains it
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_fd = self._wake_r.fileno()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: the program thread that leads now (None: none, or the background thread)
        self.leader_thread: int | None = None

    # --- lanes ----------------------------------------------------------------------
    def add(self, lane: InLane) -> None:
        """Read `lane` from now on (its socket made non-blocking)."""
        lane.sock.setblocking(False)
        with self._mutex:
            if self._closed:
                lane.close()
                return
            self._lanes[lane.fd] = lane
            if self._thread is None:
                self._thread = threading.Thread(target=self._background, daemon=True,
                                                name="dagdiff-lanes-in")
                self._thread.start()
            followers = list(self._followers)
        self.kick()                              # the leader polls the new socket too
        _notify(followers)                       # a waiting program may lead now

    @property
    def has_lanes(self) -> bool:
        return bool(self._lanes)

    @property
    def leader(self) -> bool:
        """Whether some thread leads now."""
        return self._lead.locked()

    def peers(self) -> list[str]:
        """The addresses of the workers whose lanes to this one are open."""
        with self._mutex:
            return sorted(lane.peer for lane in self._lanes.values())

    # --- leading ----------------------------------------------------------------------
    def pump(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """Lead for one poll of at most `timeout` s: read and hand on what arrives on
        any lane (a kick ends the poll early). `stop` is asked once the lead is held: True
        (the caller's run was told something meanwhile, and the kick may have gone to
        another leader) returns without polling. False when another thread leads or no
        lane is open: the caller waits on its condition instead."""
        if not self._lanes or not self._lead.acquire(blocking=False):
            return False
        self.leader_thread = threading.get_ident()
        try:
            if not stop():
                self._poll(timeout)
        finally:
            self.leader_thread = None
            self._release()
        return True

    def _release(self) -> None:
        self._lead.release()
        with self._mutex:
            followers = list(self._followers)
        _notify(followers)

    def _poll(self, timeout: float) -> int:
        """Wait up to `timeout` s for a lane to be readable (or a kick); read each that
        is. Returns how many lanes were read."""
        lanes = list(self._lanes.values())
        ready = [lane for lane in lanes if lane.ready()]
        if not ready:
            poller = select.poll()
            poller.register(self._wake_fd, select.POLLIN)
            for lane in lanes:
                poller.register(lane.fd, select.POLLIN)
            try:
                events = poller.poll(max(0, int(timeout * 1000)))
            except InterruptedError:
                events = []
            for fd, _ in events:
                if fd == self._wake_fd:
                    self._drain_kicks()
                else:
                    lane = self._lanes.get(fd)
                    if lane is not None:
                        ready.append(lane)
        for lane in ready:
            if not lane.pump():
                self._drop(lane)
        return len(ready)

    def _drop(self, lane: InLane) -> None:
        with self._mutex:
            if self._lanes.get(lane.fd) is lane:
                del self._lanes[lane.fd]
        lane.close()

    def kick(self) -> None:
        """End the leader's poll now (a run it leads for was told something)."""
        try:
            self._wake_w.send(b"k")
        except OSError:                          # full: a kick is pending
            pass

    def _drain_kicks(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    # --- followers ----------------------------------------------------------------------
    def follow(self, cond: Any) -> None:
        """Wake `cond` (held by a waiting program) whenever the lead is given up or a lane
        opens."""
        with self._mutex:
            self._followers.add(cond)

    def unfollow(self, cond: Any) -> None:
        with self._mutex:
            self._followers.discard(cond)

    # --- programs running -----------------------------------------------------------------
    @contextlib.contextmanager
    def claimed(self) -> Iterator[None]:
        """While a program runs here: the background thread leaves the sockets to it."""
        with self._mutex:
            self._claims += 1
            kick = self._background_leads
        if kick:
            self.kick()
        try:
            yield
        finally:
            with self._mutex:
                self._claims -= 1
                if not self._claims:
                    self._parked.notify_all()     # the background thread leads again

    def _background(self) -> None:
        """Lead while no program runs here; while programs run, drain the lanes without
        waiting every `_PARKED` s when none of them leads (a program busy computing or
        writing to a peer whose program writes back is not reading: the sockets must not
        fill up both ways)."""
        while True:
            with self._mutex:
                if self._closed:
                    return
                if self._claims > 0:
                    self._parked.wait(_PARKED)
                    if self._closed:
                        return
                busy = self._claims > 0
            if busy:
                if self._lead.acquire(blocking=False):
                    try:
                        for _ in range(64):        # until nothing is left (bounded)
                            if not self._poll(0.0):
                                break
                    except Exception:                # noqa: BLE001 - keep reading
                        log.exception("dagdiff: reading the inbound lanes failed")
                    finally:
                        self._release()
                continue
            if not self._lead.acquire(timeout=_PARKED):
                continue
            try:
                with self._mutex:
                    if self._claims > 0:
                        continue
                    self._background_leads = True
                try:
                    self._poll(1.0)
                finally:
                    with self._mutex:
                        self._background_leads = False
            except Exception:                    # noqa: BLE001 - keep reading
                log.exception("dagdiff: reading the inbound lanes failed")
            finally:
                self._release()

    def close(self) -> None:
        """Stop: the background thread ends; open lanes are closed."""
        with self._mutex:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
            self._parked.notify_all()
        self.kick()
        for lane in lanes:
            lane.close()


def _notify(conds: list[Any]) -> None:
    for cond in conds:
        with cond:
            cond.notify_all()
