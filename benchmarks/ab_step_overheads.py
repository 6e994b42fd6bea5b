"""A/B of per-step overheads in one cluster, in alternating rounds: distributed's message
batching intervals, pickling a template's program bodies every step, and gathering a
step's outputs through Dask instead of taking what the programs push.

The job: the tiny job by default (--width 64 --batch 64 --layers 4, 2 stages, 1F1B x
--microbatches 8) on `dd.local_cluster(2)`. Per round and mode, the median of --steps
`step.compute(params, x, t)` calls, the median of --steps `Trainer.step` (adam) +
`loss.result()`, and one `Trainer.fit` over 4 x --steps batches (after a warm fit): per step.

--what intervals: "distributed" puts back distributed's own intervals (client -> scheduler
    10 ms, scheduler -> workers 5 ms, workers -> scheduler and scheduler -> client 2 ms;
    dask config ``dagdiff.batched-send-interval: default`` in the client) against
    dagdiff's 1 ms ("dagdiff").
--what bodies: "whole" pickles every program whole, as before program bodies were cached
    (`Program.__reduce__` replaced in the client and on the workers for the round),
    against "cached".
--what pushes: "gather" (dask config ``dagdiff.direct.push-outputs: false``: `step.compute`
    gathers its outputs through Dask) against "push" (the programs push them to the
    client's inbox); only `step.compute` pushes.
--gap-ms G: sleep G ms before each timed `step.compute` and `Trainer.step` (the user's own
    work between steps, during which the previous step's Dask traffic ends; on 2 cores
    steps back to back overlap it with the next step's start).
Measures dagdiff against itself (no peer): the ratio B / A of each row is printed.
Usage: python benchmarks/ab_step_overheads.py [--what intervals|bodies|pushes] [--rounds 3]
       [--steps 25] [--gap-ms 0] [--width 64] [--batch 64] [--layers 4] [--microbatches 8]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import dask
import optax

import dagdiff as dd

try:
    from common import mlp_data, two_stage_loss
except ImportError:                       # run from the repository root
    from benchmarks.common import mlp_data, two_stage_loss


def _scheduler_intervals(seconds: float, dask_scheduler: Any = None) -> None:
    for stream in [*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()]:
        stream.interval = seconds


def _worker_interval(seconds: float, dask_worker: Any = None) -> None:
    dask_worker.batched_stream.interval = seconds


def _bodies(cached: bool, dask_worker: Any = None) -> None:
    """Pickle template programs with their cached body (True) or whole (False)."""
    from dagdiff.runtime.direct import program

    if not hasattr(program, "_cached_reduce"):
        program._cached_reduce = program.Program.__reduce__     # type: ignore[attr-defined]

    def whole(self: Any) -> tuple[Any, ...]:
        return program.Program, (self.key, self.step, *self._body())

    program.Program.__reduce__ = (program._cached_reduce  # type: ignore[attr-defined]
                                  if cached else whole)


def set_mode(client: Any, what: str, mode: str) -> None:
    if what == "intervals":
        mine = mode == "dagdiff"
        dask.config.set({"dagdiff.batched-send-interval": "1ms" if mine else "default"})
        client.run_on_scheduler(_scheduler_intervals, 0.001 if mine else 0.002)
        if not mine:                       # distributed: 5 ms to workers, 2 ms to clients
            client.run_on_scheduler(_worker_streams_default)
        client.run(_worker_interval, 0.001 if mine else 0.002)
        client.scheduler_comm.interval = 0.001 if mine else 0.010
    elif what == "pushes":
        dask.config.set({"dagdiff.direct.push-outputs": mode == "push"})
    else:
        cached = mode == "cached"
        _bodies(cached)
        client.run(_bodies, cached)


def _worker_streams_default(dask_scheduler: Any = None) -> None:
    for stream in dask_scheduler.stream_comms.values():
        stream.interval = 0.005


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=["intervals", "bodies", "pushes"], default="intervals")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    modes = {"intervals": ("distributed", "dagdiff"), "bodies": ("whole", "cached"),
             "pushes": ("gather", "push")}[args.what]

    from distributed import Client

    cluster = dd.local_cluster(2)
    client = Client(cluster)
    params, data = mlp_data(args.width, args.batch, args.layers)
    step = dd.value_and_grad(two_stage_loss, microbatches=args.microbatches, schedule="1F1B")
    trainer = dd.Trainer(two_stage_loss, optax.adam(1e-3), microbatches=args.microbatches,
                         schedule="1F1B")
    rows: dict[str, dict[str, list[float]]] = {m: {"step.compute": [], "Trainer.step": [],
                                                   "fit": []} for m in modes}
    try:
        for r in range(args.rounds):
            for mode in modes:
                set_mode(client, args.what, mode)
                times = []
                for i in range(args.steps + 3):
                    x, t = data[i % len(data)]
                    time.sleep(args.gap_ms / 1e3)
                    t0 = time.perf_counter()
                    step.compute(params, x, t, client=client)
                    times.append(time.perf_counter() - t0)
                rows[mode]["step.compute"].append(statistics.median(times[3:]))
                state, times = trainer.init(params), []
                for i in range(args.steps + 3):
                    x, t = data[i % len(data)]
                    time.sleep(args.gap_ms / 1e3)
                    t0 = time.perf_counter()
                    state, loss = trainer.step(state, x, t)
                    loss.result()
                    times.append(time.perf_counter() - t0)
                rows[mode]["Trainer.step"].append(statistics.median(times[3:]))
                batches = [data[i % len(data)] for i in range(4 * args.steps)]
                trainer.fit(batches[:args.steps], state=trainer.init(params), progress=False)
                t0 = time.perf_counter()
                trainer.fit(batches, state=trainer.init(params), progress=False)
                rows[mode]["fit"].append((time.perf_counter() - t0) / len(batches))
                print(f"round {r + 1} {mode:12s} " + ", ".join(
                    f"{k} {v[-1] * 1e3:.1f} ms" for k, v in rows[mode].items()), flush=True)
    finally:
        set_mode(client, args.what, modes[1])
        client.close()
        cluster.close()
    a, b = modes
    print(f"\n{args.layers} layers x {args.width}, batch {args.batch}, 2 stages, 1F1B x "
          f"{args.microbatches}; median of {args.steps} steps ({args.gap_ms:g} ms apart), "
          f"median of {args.rounds} rounds")
    print(f"{'':14s} {a:>12s} {b:>12s}   {b} / {a}")
    for k in rows[a]:
        ma, mb = statistics.median(rows[a][k]), statistics.median(rows[b][k])
        ratios = ", ".join(f"{y / x:.2f}" for x, y in zip(rows[a][k], rows[b][k]))
        print(f"{k:14s} {ma * 1e3:9.1f} ms {mb * 1e3:9.1f} ms   {mb / ma:.2f} [{ratios}]")


if __name__ == "__main__":
    main()
