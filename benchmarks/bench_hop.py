"""One value from one idle worker's program to another's: lanes against the comm on the event
loop, and the floor of a raw socket between two Python processes, in one run.

On `dd.local_cluster(2)`, a thread of worker A (as a program sends) sends `--messages`
small values (a 2 KiB array, the size of the tiny job's activation) to worker B, `--gap-ms` apart, each
carrying the time it was sent; a thread of B waits for each as a program waits
(`ProgramRun`'s condition) and notes when it woke. Per transport, in alternating rounds
(dask config ``dagdiff.direct.lanes`` switched on the sender), the median of send -> the
message read on B (`_received`, on B's lane reader thread or event loop) and send -> the
waiting thread awake. The floor: the same with a plain TCP socket between two processes,
one thread reading and a second one waiting on a condition (no Dask, no dagdiff). Clocks
are the machine's (`time.time()` in both processes). Measures transport and wake-ups
only, not compute.

Usage: python benchmarks/bench_hop.py [--messages 300] [--rounds 3] [--gap-ms 4]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from typing import Any

import numpy as np


def _wait_for(prefix: str, n: int, dask_worker: Any) -> bool:
    """On B: a thread that waits for run `prefix-i`'s value k as a program would."""
    rt = dask_worker.extensions["dagdiff"]
    transport = rt.transport
    read_at: dict[str, float] = {}
    received = type(transport)._received

    def noted(msgs: Any, peer: str) -> None:
        t = time.time()
        for d in msgs if isinstance(msgs, (list, tuple)) else [msgs]:
            if isinstance(d, dict):
                read_at[d.get("run")] = t
        received(transport, msgs, peer)

    transport._received = noted              # the lane's reader / the loop call it
    out: list[tuple[float, float]] = []

    def body() -> None:
        for i in range(n):
            run = f"{prefix}-{i}"
            st = rt._state(run)
            with st.cond:
                while "k" not in st.values:
                    st.cond.wait(5.0)
                woke = time.time()
                sent = float(st.values["k"][0].flat[0])
            out.append((read_at.get(run, woke) - sent, woke - sent))
            rt._finish(run, "ended")

    th = threading.Thread(target=body, daemon=True)
    th.start()
    dask_worker._dagdiff_hop = (th, out)
    return True


async def _results(dask_worker: Any) -> list[tuple[float, float]]:
    import asyncio

    th, out = dask_worker._dagdiff_hop
    await asyncio.get_running_loop().run_in_executor(None, th.join, 120)
    del dask_worker._dagdiff_hop
    return out


def _send(to: str, prefix: str, n: int, gap: float, lanes: bool, dask_worker: Any) -> bool:
    """On A: a thread (not the event loop, as a program) sends the n values."""
    import dask

    from dagdiff.runtime.direct.messages import Value, pack

    rt = dask_worker.extensions["dagdiff"]

    def body() -> None:
        with dask.config.set({"dagdiff.direct.lanes": lanes}):
            for i in range(n):
                time.sleep(gap)
                rt.transport.send(to, Value(f"{prefix}-{i}", "k", 1,
                                            pack(np.full((4, 64), time.time()))),
                                  lambda e: None)

    threading.Thread(target=body, daemon=True).start()
    return True


def _floor_receiver(port: int, n: int, q: Any) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    q.put("ready")
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb", buffering=1 << 16)
    cond = threading.Condition()
    box: list[tuple[float, float]] = []

    def read() -> None:
        for _ in range(n):
            data = reader.read(2048 + 8)
            t = time.time()
            with cond:
                box.append((struct.unpack("d", data[:8])[0], t))
                cond.notify()

    threading.Thread(target=read, daemon=True).start()
    out = []
    for _ in range(n):
        with cond:
            while not box:
                cond.wait()
            sent, read_at = box.pop(0)
        out.append((read_at - sent, time.time() - sent))
    q.put(out)


def floor(n: int, gap: float) -> list[tuple[float, float]]:
    """The raw socket: one process sends 2 KiB + its time, the other's reader thread hands
    it to a waiting thread."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q: Any = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_floor_receiver, args=(port, n, q))
    proc.start()
    q.get()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pad = bytes(2048)
    for _ in range(n):
        time.sleep(gap)
        sock.sendall(struct.pack("d", time.time()) + pad)
    out = q.get()
    proc.join()
    sock.close()
    return out


def _summary(name: str, got: list[tuple[float, float]]) -> str:
    read = sorted(r for r, _ in got)
    woke = sorted(w for _, w in got)
    k = len(woke)
    return (f"  {name:34s} read {1e6 * statistics.median(read):6.0f} us, awake "
            f"{1e6 * statistics.median(woke):6.0f} us (p10 {1e6 * woke[k // 10]:.0f}, "
            f"p90 {1e6 * woke[9 * k // 10]:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=4.0)
    args = ap.parse_args()
    from distributed import Client

    import dagdiff as dd

    n, gap, skip = args.messages, args.gap_ms / 1e3, min(20, args.messages // 10)
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    got: dict[str, list[tuple[float, float]]] = {"lanes": [], "comm": [], "floor": []}
    try:
        a, b = sorted(client.scheduler_info()["workers"])
        for r in range(args.rounds):
            for lanes in (True, False):
                prefix = f"hop-{lanes}-{r}"
                client.run(_wait_for, prefix, n, workers=[b])
                client.run(_send, b, prefix, n, gap, lanes, workers=[a])
                out = client.run(_results, workers=[b])[b]
                got["lanes" if lanes else "comm"] += out[skip:]
            got["floor"] += floor(n, gap)[skip:]
    finally:
        client.close()
        cluster.close()
    print(f"one {2048} B value, idle workers, {args.rounds} rounds x {n} messages "
          f"{args.gap_ms:g} ms apart; median since sent")
    print(_summary("dagdiff, lanes", got["lanes"]))
    print(_summary("dagdiff, comm on the event loop", got["comm"]))
    print(_summary("raw socket, two Python threads", got["floor"]))
    med = {k: statistics.median(w for _, w in v) for k, v in got.items()}
    print(f"ratios: lanes / comm {med['lanes'] / med['comm']:.2f}, "
          f"lanes / floor {med['lanes'] / med['floor']:.2f}")


if __name__ == "__main__":
    main()
