"""The receiving ends of a worker's lanes (`runtime/direct/inbound.py`): a waiting program
reads them itself, one thread leads at a time, nothing is lost, reordered or left unread,
on socket pairs in one process (no cluster)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from dagdiff.runtime.direct.inbound import Inbound, InLane
from dagdiff.runtime.direct.lanes import encode, write_frames
from dagdiff.runtime.direct.messages import Value, from_wire, pack, to_wire
from dagdiff.runtime.direct.run import ProgramRun
from dagdiff.runtime.direct.transport import _decoded


class Worker:
    """One worker's inbound side: its lanes, its runs, where each message was read."""

    def __init__(self) -> None:
        self.inbound = Inbound()
        self.runs: dict[str, ProgramRun] = {}
        self.read_by: list[tuple[str, str]] = []      # (key, name of the reading thread)
        self.ended: list[str] = []

    def run(self, name: str) -> ProgramRun:
        if name not in self.runs:
            self.runs[name] = ProgramRun(name, 60.0, lambda *a: None, lambda *a: None,
                                         self.inbound)
        return self.runs[name]

    def on_message(self, d: Any) -> None:
        msg = from_wire(_decoded(d))
        self.read_by.append((msg.key, threading.current_thread().name))
        self.run(msg.run).deliver(msg)

    def lane(self, peer: str) -> socket.socket:
        """A new lane from `peer`: returns the sending end."""
        send, recv = socket.socketpair()
        self.inbound.add(InLane(recv, peer, self.on_message,
                                lambda: self.ended.append(peer)))
        return send


def send(sock: socket.socket, run: str, key: str, value: Any) -> None:
    write_frames(sock, [encode(to_wire(Value(run, key, 1, pack(value))), {})])


def wait_for(st: ProgramRun, key: str, timeout: float = 10.0) -> Any:
    """Wait as a program waits (`ProgramRun._wait`) for `key`; its value."""
    deadline = time.monotonic() + timeout
    with st.cond:
        while key not in st.values:
            left = deadline - time.monotonic()
            assert left > 0, f"{key} never came"
            st._wait(min(left, 1.0))
        return st.values[key][0]


def in_thread(fn: Any, *args: Any, name: str) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:              # noqa: BLE001 - the test reads it
            out.append(e)

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t, out


def waiting_program(worker: Worker, run: str, key: str
                    ) -> tuple[threading.Thread, list[Any]]:
    """A program (thread ``program-1``) of `run` that runs here and waits for `key`."""
    st = worker.run(run)

    def program() -> Any:
        with worker.inbound.claimed():
            return wait_for(st, key)

    return in_thread(program, name="program-1")


def until_ended(worker: Worker, peer: str) -> list[str]:
    """The lanes told ended, once `peer`'s is among them (or after 10 s)."""
    deadline = time.monotonic() + 10
    while peer not in worker.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.ended


@pytest.fixture
def worker() -> Any:
    w = Worker()
    yield w
    w.inbound.close()


def test_a_waiting_program_reads_its_value_off_the_lane_itself(worker: Worker) -> None:
    """While a program runs here (`claimed`), the program that waits reads the socket and
    the value is delivered on its own thread, not on the background reader's."""
    a = worker.lane("tcp://a:1")
    t, out = waiting_program(worker, "r1", "x")
    time.sleep(0.05)                               # it leads, polling the lane
    send(a, "r1", "x", np.arange(6.0))
    t.join(10)
    np.testing.assert_array_equal(out[0], np.arange(6.0))
    assert worker.read_by == [("x", "program-1")]


def test_without_a_program_the_background_thread_reads(worker: Worker) -> None:
    """No program runs: messages (for a run whose program has not started) are read as
    they come by the background thread ``dagdiff-lanes-in``."""
    a = worker.lane("tcp://a:1")
    for i in range(5):
        send(a, "early", f"k{i}", np.full(3, float(i)))
    deadline = time.monotonic() + 10
    while len(worker.read_by) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [k for k, _ in worker.read_by] == [f"k{i}" for i in range(5)]
    assert {n for _, n in worker.read_by} == {"dagdiff-lanes-in"}
    assert sorted(worker.run("early").values) == [f"k{i}" for i in range(5)]


def test_two_waiting_programs_one_leads_the_other_is_handed_its_values(
        worker: Worker) -> None:
    """Two runs' programs wait at once on values from two peers: one thread reads at a
    time, each program gets every one of its values in order, whoever read them."""
    a, b = worker.lane("tcp://a:1"), worker.lane("tcp://b:1")
    n = 200

    def program(run: str) -> list[float]:
        st = worker.run(run)
        with worker.inbound.claimed():
            return [float(wait_for(st, f"k{i}")[0]) for i in range(n)]

    t1, out1 = in_thread(program, "r1", name="program-1")
    t2, out2 = in_thread(program, "r2", name="program-2")
    for i in range(n):                   # interleaved, each run's values on both lanes
        send(a if i % 2 else b, "r1", f"k{i}", np.full(2, float(i)))
        send(b if i % 2 else a, "r2", f"k{i}", np.full(2, -float(i)))
    t1.join(20)
    t2.join(20)
    assert out1 == [[float(i) for i in range(n)]]
    assert out2 == [[-float(i) for i in range(n)]]
    readers = {name for _, name in worker.read_by}
    assert readers <= {"program-1", "program-2", "dagdiff-lanes-in"}
    assert readers & {"program-1", "program-2"}       # the programs read, not a thread


def test_a_cancel_wakes_a_program_that_polls_the_lanes(worker: Worker) -> None:
    """A run cancelled while its program leads (blocked in its poll of the sockets) wakes
    at once through the wake pipe, not after its poll's timeout."""
    peer = worker.lane("tcp://a:1")             # kept open: the lane stays
    st = worker.run("r1")
    woke: list[float] = []

    def program() -> None:
        with worker.inbound.claimed(), st.cond:
            while st.abort is None:
                st._wait(30.0)
            woke.append(time.monotonic())

    t, _ = in_thread(program, name="program-1")
    time.sleep(0.1)
    t0 = time.monotonic()
    st.cancel("released")
    t.join(10)
    assert woke and woke[0] - t0 < 5.0
    assert worker.inbound.peers() == ["tcp://a:1"]   # it polled the lane all along
    peer.close()


def test_large_and_small_values_keep_their_order(worker: Worker) -> None:
    """Frames larger than the lane's buffer are read into their own buffer (what was read
    ahead of them first): values alternate 2 MB / 24 B and arrive whole, in order."""
    a = worker.lane("tcp://a:1")
    st = worker.run("r1")
    n = 30

    def sender() -> None:
        for i in range(n):
            size = 250_000 if i % 2 else 3
            send(a, "r1", f"k{i}", np.full(size, float(i)))

    def program() -> list[tuple[int, float]]:
        with worker.inbound.claimed():
            got = []
            for i in range(n):
                v = wait_for(st, f"k{i}")
                assert np.all(v == float(i))
                got.append((v.size, float(v[0])))
            return got

    t, out = in_thread(program, name="program-1")
    s, _ = in_thread(sender, name="sender")
    t.join(30)
    s.join(30)
    assert out == [[(250_000 if i % 2 else 3, float(i)) for i in range(n)]]


def test_a_lane_that_ends_is_dropped_and_its_end_told(worker: Worker) -> None:
    """The sender hangs up while a program polls: the lane leaves the polled set, its
    `ended` callback runs, and the other lane keeps delivering to the program."""
    a, b = worker.lane("tcp://a:1"), worker.lane("tcp://b:1")
    t, out = waiting_program(worker, "r1", "x")
    time.sleep(0.05)
    a.close()
    assert until_ended(worker, "tcp://a:1") == ["tcp://a:1"]
    assert worker.inbound.peers() == ["tcp://b:1"]
    send(b, "r1", "x", np.ones(2))
    t.join(10)
    np.testing.assert_array_equal(out[0], np.ones(2))


def test_lanes_are_drained_while_programs_compute(worker: Worker) -> None:
    """A program that runs but does not wait (computing, or blocked writing to a peer that
    writes back) reads nothing: the background thread still drains the lanes every
    `_PARKED` s, so a sender of more than a socket's buffer is never stuck."""
    a = worker.lane("tcp://a:1")
    a.settimeout(10.0)                             # stuck would raise here
    with worker.inbound.claimed():                 # a program runs and never waits
        for i in range(40):                        # 40 x 400 KB: far over the buffers
            send(a, "busy", f"k{i}", np.full(50_000, float(i)))
        deadline = time.monotonic() + 10
        while len(worker.read_by) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [k for k, _ in worker.read_by] == [f"k{i}" for i in range(40)]


def test_a_program_without_the_lanes_waits_on_its_condition() -> None:
    """``dagdiff.direct.program-reads`` false: a run gets no inbound and waits on its
    condition alone (the transport's reader hands it its values)."""
    st = ProgramRun("r", 60.0, lambda *a: None, lambda *a: None, None)
    assert not st.reads_lanes

    def later() -> None:
        time.sleep(0.05)
        st.deliver(Value("r", "x", 1, np.ones(3)))

    threading.Thread(target=later, daemon=True).start()
    np.testing.assert_array_equal(wait_for(st, "x"), np.ones(3))


def test_closing_stops_the_background_thread_and_closes_the_lanes() -> None:
    w = Worker()
    w.lane("tcp://a:1")
    thread = w.inbound._thread
    assert thread is not None and thread.name == "dagdiff-lanes-in"
    w.inbound.close()
    thread.join(5)
    assert not thread.is_alive()
    assert w.ended == ["tcp://a:1"]
    assert w.inbound.peers() == []


def test_a_half_sent_message_blocks_neither_other_lanes_nor_a_cancel(worker: Worker) -> None:
    """A peer stalls in the middle of a large message (its header and part of its frames
    sent): the program that leads still reads its value from another lane, and is woken
    by a cancel; the stalled message is completed when its bytes come."""
    stalled, other = worker.lane("tcp://stalled:1"), worker.lane("tcp://other:1")
    frames = encode(to_wire(Value("r2", "big", 1, pack(np.full(200_000, 7.0)))), {})
    wire = b"".join(_framed(frames))
    a = worker.run("r1")
    b = worker.run("r2")

    def program() -> tuple[Any, Any]:
        with worker.inbound.claimed():
            got = wait_for(a, "x")
            with a.cond:
                while a.abort is None:
                    a._wait(30.0)
            return got, a.abort

    t, out = in_thread(program, name="program-1")
    stalled.sendall(wire[:100_000])              # then nothing for a while
    time.sleep(0.05)
    send(other, "r1", "x", np.ones(2))
    time.sleep(0.05)
    a.cancel("released")
    t.join(10)
    assert not t.is_alive(), "the program never woke"
    np.testing.assert_array_equal(out[0][0], np.ones(2))
    assert out[0][1] == "released"
    stalled.sendall(wire[100_000:])              # the rest: the message is whole
    np.testing.assert_array_equal(wait_for(b, "big"), np.full(200_000, 7.0))
    assert worker.ended == []


def _framed(frames: list[Any]) -> list[bytes]:
    """One message as `lanes.write_frames` puts it on the wire."""
    import struct

    lengths = [memoryview(f).nbytes for f in frames]
    return [struct.pack(f"<Q{len(frames)}Q", len(frames), *lengths),
            *(bytes(memoryview(f)) for f in frames)]


@pytest.mark.parametrize("garbage", ["huge frame", "too many frames", "not a message"])
def test_a_lane_that_sends_garbage_is_dropped_not_the_program(worker: Worker,
                                                               garbage: str) -> None:
    """Bytes that cannot be a message (a frame too large to hold, a frame count past any
    message, frames distributed cannot load) drop that lane or that message alone: the
    waiting program sees no exception and gets its value from another lane."""
    import struct

    bad, good = worker.lane("tcp://bad:1"), worker.lane("tcp://good:1")
    st = worker.run("r1")
    t, out = waiting_program(worker, "r1", "x")
    time.sleep(0.05)
    if garbage == "huge frame":
        bad.sendall(struct.pack("<QQ", 1, 1 << 40) + bytes(16))
    elif garbage == "too many frames":
        bad.sendall(struct.pack("<Q", 1 << 30) + bytes(64))
    else:
        bad.sendall(struct.pack("<QQ", 1, 5) + b"\xff" * 5)
    time.sleep(0.05)
    send(good, "r1", "x", np.arange(3.0))
    t.join(10)
    np.testing.assert_array_equal(out[0], np.arange(3.0))
    if garbage == "not a message":               # framed right: the lane goes on
        send(bad, "r1", "y", np.ones(1))
        np.testing.assert_array_equal(wait_for(st, "y"), np.ones(1))
    else:
        assert until_ended(worker, "tcp://bad:1") == ["tcp://bad:1"]
        assert worker.inbound.peers() == ["tcp://good:1"]


def test_news_before_the_lead_is_taken_is_not_lost(worker: Worker, monkeypatch: Any) -> None:
    """A program lets go of its condition to lead; before it holds the lead it is
    cancelled, and the kick that should end its poll is drained by another leader (the
    background thread's drain): it still wakes at once, not after its poll's timeout."""
    peer = worker.lane("tcp://a:1")             # kept open: the lane stays
    st = worker.run("r1")
    pump = worker.inbound.pump
    entered, cancelled = threading.Event(), threading.Event()
    first = [True]

    def late_pump(timeout: float, stop: Any = lambda: False) -> bool:
        if first[0] and threading.current_thread().name == "program-1":
            first[0] = False
            entered.set()                        # its condition is free, no lead yet
            cancelled.wait(10)
            worker.inbound._drain_kicks()        # another leader took the kick
        return pump(timeout, stop)

    monkeypatch.setattr(worker.inbound, "pump", late_pump)

    def program() -> float:
        with worker.inbound.claimed(), st.cond:
            while st.abort is None:
                st._wait(30.0)
            return time.monotonic()

    t, out = in_thread(program, name="program-1")
    assert entered.wait(10)
    st.cancel("released")
    cancelled.set()
    t.join(20)
    assert not t.is_alive() and out, "the program never woke"
    peer.close()
    assert first == [False]                      # the delayed path was taken
