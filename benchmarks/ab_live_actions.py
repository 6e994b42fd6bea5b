"""What reporting direct-dispatch actions to the dashboard costs (`dagdiff.runtime.live`).

A 2-worker `dd.local_cluster` trains a 2-stage MLP with 1F1B (`dd.Trainer.fit`, steps in
flight) in rounds that alternate dask config ``dagdiff.dashboard.live-actions`` off and on
(A, B, A, B, ...), with the scheduler's task stream kept (as when a dashboard page is
open: the costly case); prints the median step time of each and their ratio. Then the
per-action cost on each side, in this process: the worker's `ActionReporter` (batching,
packing each report with msgpack as the worker's batched stream does) and the scheduler's
`LiveActions` (one task-stream record). Noisy shared machine: compare medians of rounds.
Usage: python benchmarks/ab_live_actions.py [--width 256] [--steps 30] [--rounds 6]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import dask
import msgpack
import optax
from distributed import Client
from distributed.diagnostics.task_stream import TaskStreamPlugin

import dagdiff as dd
from common import mlp_data, two_stage_loss as loss_fn
from dagdiff.runtime.live import TOPIC, ActionReporter, LiveActions


def _keep_task_stream(dask_scheduler: Any = None) -> None:
    if TaskStreamPlugin.name not in dask_scheduler.plugins:
        dask_scheduler.add_plugin(TaskStreamPlugin(dask_scheduler))


def fit_rounds(a: Any) -> None:
    params, batches = mlp_data(a.width, a.batch)
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True,
                               env={"XLA_FLAGS": ""})
    client = Client(cluster)
    client.run_on_scheduler(_keep_task_stream)
    tr = dd.Trainer(loss_fn, optax.adam(1e-3), microbatches=a.microbatches, schedule="1f1b",
                    client=client)
    state, _ = tr.fit(batches, steps=4, params=params, progress=False)   # compile, place
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for live in (False, True):
            with dask.config.set({"dagdiff.dashboard.live-actions": live}):
                t0 = time.perf_counter()
                state, losses = tr.fit(itertools.cycle(batches), steps=a.steps, state=state,
                                       progress=False)
                times[live].append((time.perf_counter() - t0) / a.steps)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    n = client.run_on_scheduler(
        lambda dask_scheduler: len(dask_scheduler.get_events(TOPIC)))
    print(f"MLP 4x{a.width}, batch {a.batch}, 2 stages, 1F1B x{a.microbatches}, "
          f"{a.rounds} x {a.steps} steps per setting, interleaved")
    print(f"  step {off * 1e3:.1f} ms with live actions off, {on * 1e3:.1f} ms on: "
          f"{on / off - 1:+.1%} (rounds off {[round(t * 1e3, 1) for t in times[False]]}, "
          f"on {[round(t * 1e3, 1) for t in times[True]]}); {n} reports kept by the "
          "scheduler's event log (bounded: distributed.admin.low-level-log-length)")
    client.close()
    cluster.close()


class _Worker:
    """Stands in for a worker: packs each report as its batched stream will (msgpack)."""

    scheduler_delay = 0.0

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def log_event(self, topic: str, msg: Any) -> None:
        msgpack.packb({"op": "log-event", "topic": topic, "msg": msg})
        self.sent.append({"op": "log-event", "topic": topic, "msg": msg})


class _Scheduler:
    def __init__(self) -> None:
        self.plugins: dict[str, Any] = {}


def per_action(n: int = 200_000) -> None:
    keys = [f"fwd_dense-s0-m{i % 8}-n6-1b3f4160a91954dc" for i in range(n)]
    w = _Worker()
    r = ActionReporter(w, "prog_slot0-n0-1b3f4160a91954dc")
    base = r.last
    t0 = time.perf_counter()
    for i, k in enumerate(keys):                  # 1 ms actions: a report per 100
        r.add(k, base + i * 1e-3, base + i * 1e-3 + 5e-4)
    r.flush()
    worker = (time.perf_counter() - t0) / n
    s = _Scheduler()
    s.plugins["task-stream"] = TaskStreamPlugin(s, maxlen=100_000)
    plugin = LiveActions()
    plugin.scheduler = s
    msgs = [dict(m["msg"], worker="tcp://127.0.0.1:1") for m in w.sent]
    t0 = time.perf_counter()
    for m in msgs:
        plugin.log_event(TOPIC, m)
    sched = (time.perf_counter() - t0) / n
    print(f"  per action: worker {worker * 1e6:.2f} us ({len(w.sent)} reports of "
          f"{n // max(len(w.sent), 1)}), scheduler {sched * 1e6:.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    fit_rounds(a)
    per_action()


if __name__ == "__main__":
    main()
