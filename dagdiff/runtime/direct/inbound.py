"""The receiving ends of a worker's lanes, read by whichever thread leads: a program that
waits for a value reads the sockets itself, else one background thread does.

A value's hop from one idle worker to another used to end with two thread wake-ups: the
lane's reader thread woke on the socket, then woke the waiting program through its
condition. On this project's 2-core machine the second wake-up cost ~60-100 us of a
~250 us hop. Here the waiting program polls every inbound lane itself (`Inbound.pump`) and
reads what arrives, handing each message on as the reader thread did (other runs' messages
too: their programs are notified as before); the kernel wakes the one thread that needs
the value.

One thread leads at a time (the lead is a lock): a program waiting while another leads
follows (waits on its condition, as before: the leader delivers to it) and is woken when
the lead is free. While any program runs on the worker (`claimed`), the background thread
stays off the sockets; otherwise it leads, so messages for runs that have not started here,
a lane's end and large values are read as they come, as before. Every inbound lane is
drained by whoever leads (a program waiting for one peer reads the others too), so a
sender never blocks on a full socket while its receiver waits for something else.

A lane's socket came from a comm distributed opened (`lanes.accept_lane`); its messages
are framed as `lanes.write_frames` writes them.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
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
#: seconds one blocking read of a message's rest may make no progress
RECV_TIMEOUT = 30.0
#: frames up to this size are read through the lane's buffer; larger ones into their own
_SMALL_FRAME = 64 * 1024
_CHUNK = 256 * 1024
_COUNT = struct.Struct("<Q")


class InLane:
    """One inbound lane: its socket (read only by the thread that leads), a buffer of
    bytes read ahead, and what to do with each message."""

    def __init__(self, sock: socket.socket, peer: str,
                 on_message: Callable[[Any], None], ended: Callable[[], None]) -> None:
        self.sock = sock
        self.peer = peer
        # a file object of the socket holds its descriptor open until it is closed here,
        # whoever closes the socket meanwhile: no read on a reused descriptor
        self._raw = sock.makefile("rb", buffering=0)
        self.fd = sock.fileno()
        self._on_message = on_message
        self._ended = ended
        self._buf = bytearray()
        self._pos = 0
        self._scratch = memoryview(bytearray(_CHUNK))
        self._ssl = hasattr(sock, "pending")
        self.closed = False

    # --- reading (the leading thread only) --------------------------------------------
    def ready(self) -> bool:
        """Whether a message can be read without waiting for the socket: one is whole in
        the buffer, or TLS holds decrypted bytes the socket's poll does not show."""
        if self._complete():
            return True
        return self._ssl and self.sock.pending() > 0    # type: ignore[attr-defined]

    def _available(self) -> int:
        return len(self._buf) - self._pos

    def _complete(self) -> bool:
        have = self._available()
        if have < 8:
            return False
        (count,) = _COUNT.unpack_from(self._buf, self._pos)
        if have < 8 + 8 * count:
            return False
        lengths = struct.unpack_from(f"<{count}Q", self._buf, self._pos + 8)
        return have >= 8 + 8 * count + sum(lengths)

    def _fill(self, n: int) -> bool:
        """Read until `n` bytes are buffered (False at the lane's end)."""
        while self._available() < n:
            if self._pos and self._pos >= len(self._buf) // 2:
                del self._buf[:self._pos]
                self._pos = 0
            k = self._raw.readinto(self._scratch)
            if not k:
                return False
            self._buf += self._scratch[:k]
        return True

    def _take(self, n: int) -> Any:
        """The next `n` bytes: small ones from the buffer, a large frame into a buffer
        of its own (what is buffered of it, then the rest read straight into it)."""
        if n <= _SMALL_FRAME:
            if not self._fill(n):
                return None
            out = bytes(self._buf[self._pos:self._pos + n])
            self._pos += n
            return out
        big = bytearray(n)
        have = min(self._available(), n)
        big[:have] = self._buf[self._pos:self._pos + have]
        self._pos += have
        view = memoryview(big)
        while have < n:
            k = self._raw.readinto(view[have:])
            if not k:
                return None
            have += k
        return big

    def read_message(self) -> list[Any] | None:
        """One message's frames (waiting for the rest of a message that began), None at
        the lane's end."""
        head = self._take(8)
        if head is None:
            return None
        (count,) = _COUNT.unpack(head)
        raw = self._take(8 * count)
        if raw is None:
            return None
        frames = []
        for n in struct.unpack(f"<{count}Q", raw):
            f = self._take(n)
            if f is None:
                return None
            frames.append(f)
        return frames

    def pump(self) -> bool:
        """Read the message that is coming (the socket is readable, or `ready`) and every
        whole one buffered behind it, handing each on; False once the lane ended (or
        broke: the sender reconnects on a new lane)."""
        while True:
            try:
                frames = self.read_message()
            except (OSError, ValueError):        # reset, timeout, closed under us
                frames = None
            if frames is None:
                return False
            try:
                msg = loads(frames, deserialize=False)
            except Exception as e:               # noqa: BLE001 - a garbled message
                log.warning("dagdiff: dropped a message from %s (%s: %s)",
                            self.peer, type(e).__name__, e)
            else:
                try:
                    self._on_message(msg)
                except Exception:                # noqa: BLE001 - never stop the lane
                    log.exception("dagdiff: delivering a message from %s failed", self.peer)
            if not self._complete():
                return True

    def close(self) -> None:
        """The lane ended: close its file object and tell its handler."""
        if self.closed:
            return
        self.closed = True
        try:
            self._raw.close()
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
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- lanes ----------------------------------------------------------------------
    def add(self, lane: InLane) -> None:
        """Read `lane` from now on (its socket times out a read that stalls)."""
        lane.sock.settimeout(RECV_TIMEOUT)
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

    def peers(self) -> list[str]:
        """The addresses of the workers whose lanes to this one are open."""
        with self._mutex:
            return sorted(lane.peer for lane in self._lanes.values())

    # --- leading ----------------------------------------------------------------------
    def pump(self, timeout: float) -> bool:
        """Lead for one poll of at most `timeout` s: read and hand on what arrives on
        any lane (a kick ends the poll early). False when another thread leads or no lane
        is open: the caller waits on its condition instead."""
        if not self._lanes or not self._lead.acquire(blocking=False):
            return False
        try:
            self._poll(timeout)
        finally:
            self._release()
        return True

    def _release(self) -> None:
        self._lead.release()
        with self._mutex:
            followers = list(self._followers)
        _notify(followers)

    def _poll(self, timeout: float) -> None:
        lanes = list(self._lanes.values())
        ready = [lane for lane in lanes if lane.ready()]
        if not ready:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for lane in lanes:
                poller.register(lane.fd, select.POLLIN)
            try:
                events = poller.poll(max(0, int(timeout * 1000)))
            except InterruptedError:
                events = []
            for fd, _ in events:
                if fd == self._wake_r:
                    self._drain_kicks()
                elif fd in self._lanes:
                    ready.append(self._lanes[fd])
        for lane in ready:
            if not lane.pump():
                self._drop(lane)

    def _drop(self, lane: InLane) -> None:
        with self._mutex:
            if self._lanes.get(lane.fd) is lane:
                del self._lanes[lane.fd]
        lane.close()

    def kick(self) -> None:
        """End the leader's poll now (a run it leads for was told something)."""
        try:
            os.write(self._wake_w, b"k")
        except (BlockingIOError, OSError):       # full: a kick is pending; closed
            pass

    def _drain_kicks(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
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
                        self._poll(0.0)
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
