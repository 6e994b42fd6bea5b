"""Predicted against measured: profile a real-compute model once (`dd.profile`), predict
every built-in schedule that fits (`dd.predict` / `dd.best_schedule`), run each and
measure it (`dd.record`), and print the two side by side with the error. Then stage
balancing from measured times: a model with deliberately unequal layers split by XLA's
cost estimate (``stages=2``) and by its profile (``stages=profile``), step time before
and after.

The model: tanh dense layers --width wide, batch --batch, MSE loss, --microbatches
microbatches, on `dd.local_cluster(2)` (direct dispatch). Two layouts, so that every
built-in schedule has one that fits: 2 stages of --per-stage layers (gpipe, 1f1b,
zb-h1: one stage per worker) and 4 stages of --per-stage layers (interleaved,
looped-bfs, interleaved-zb, zb-v, dualpipev: two per worker). Measured makespan:
first to last F/B/I/W action of a step (what the simulator predicts), median of
--repeat steps after a warm-up step; also the whole step (submit to result).
The unequal model: --layers-heavy layers of `dense` then as many "heavy" ones (dense
followed by --extra elementwise tanh passes, work XLA's FLOP estimate hardly sees).
Timings on a shared 2-core machine are noisy: compare within one run.
Usage: python benchmarks/bench_planner.py [--width 1024] [--batch 512] [--microbatches 8]
       [--per-stage 4] [--repeat 3] [--extra 12] [--picture planner.png] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from distributed import Client, wait

import dagdiff as dd


@dd.layer
def dense(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


@dd.layer
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


def heavy_layer(extra: int) -> Any:
    @dd.layer(name="heavy")
    def heavy(p: Any, x: Any) -> Any:
        h = jnp.tanh(x @ p["w"] + p["b"])
        for _ in range(extra):
            h = jnp.tanh(1.5 * h + 0.1)
        return h
    return heavy


def mlp(layers: list[Any]) -> Callable[..., Any]:
    """An unstaged loss: each of `layers` (one per parameter dict), then MSE."""
    def loss_fn(params: Any, x: Any, t: Any) -> Any:
        h = x
        for layer, p in zip(layers, params):
            h = layer(p, h)
        return mse(h, t)
    return loss_fn


def make_data(n: int, width: int, batch: int, seed: int = 0) -> tuple[Any, Any, Any]:
    key = jax.random.PRNGKey(seed)
    params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width**0.5,
               "b": jnp.zeros(width)} for i in range(n)]
    x = jax.random.normal(jax.random.fold_in(key, 10_001), (batch, width))
    t = jax.random.normal(jax.random.fold_in(key, 10_002), (batch, width))
    return params, x, t


def measure(client: Any, fn: Callable[..., Any], args: tuple[Any, ...], repeat: int,
            **options: Any) -> tuple[list[float], list[float], Any]:
    """(makespans, whole-step walls, last recording) of `repeat` steps after a warm-up."""
    spans, walls, rec = [], [], None
    with client.as_current():
        loss, grads = dd.value_and_grad(fn, **options)(*args)
        for k in range(repeat + 1):
            t0 = time.perf_counter()
            with dd.record(client) as r:
                futs = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
                wait(futs)
            wall = time.perf_counter() - t0
            del futs
            if k:
                busy = [t for t in r.tasks if t.phase in ("F", "B", "I", "W")]
                spans.append(max(t.stop for t in busy) - min(t.start for t in busy))
                walls.append(wall)
                rec = r
    return spans, walls, rec


def predicted_vs_measured(client: Any, args: Any) -> list[tuple[str, float, float]]:
    rows: list[tuple[str, float, float]] = []
    print(f"\n== predicted vs measured: tanh MLP {args.width} wide, batch {args.batch}, "
          f"m = {args.microbatches}, {args.per_stage} layers per stage, 2 workers ==")
    head = (f"{'schedule':16s} {'stages':>6s} {'predicted':>10s} {'measured':>10s} "
            f"{'(min)':>8s} {'error':>7s} {'bubble p/m':>12s} {'peak live':>10s} {'step':>8s}")
    for nstages in (2, 4):
        n = nstages * args.per_stage
        fn = mlp([dense] * n)
        data = make_data(n, args.width, args.batch)
        t0 = time.perf_counter()
        prof = dd.profile(fn, microbatches=args.microbatches, stages=nstages,
                          client=client)(*data)
        print(f"\nprofiled in {time.perf_counter() - t0:.1f} s:\n{prof}")
        ranked = dd.best_schedule(prof, microbatches=args.microbatches)
        print(head)
        for name, m, pred in ranked:
            spans, walls, rec = measure(client, fn, data, args.repeat, microbatches=m,
                                        schedule=name, stages=nstages)
            got = statistics.median(spans)
            err = (pred.makespan - got) / got
            bub = rec.bubble_fraction().overall
            print(f"{name:16s} {nstages:6d} {pred.makespan * 1e3:8.1f}ms {got * 1e3:8.1f}ms "
                  f"{min(spans) * 1e3:6.1f}ms {err:+7.1%} {pred.bubble_fraction:5.1%}/"
                  f"{bub:5.1%} {max(pred.peak_live):10d} {statistics.median(walls) * 1e3:6.0f}ms",
                  flush=True)
            rows.append((name, pred.makespan, got))
            if args.picture and name == "1f1b":
                pred.timeline(rec, path=args.picture)
                print(f"   (picture: {args.picture})")
    errs = [abs(p - g) / g for _, p, g in rows]
    print(f"\n|error|: median {statistics.median(errs):.1%}, max {max(errs):.1%} over "
          f"{len(rows)} schedules")
    return rows


def balancing(client: Any, args: Any) -> None:
    n = 2 * args.per_stage
    layers = [dense] * (n // 2) + [heavy_layer(args.extra)] * (n - n // 2)
    fn = mlp(layers)
    data = make_data(n, args.width, args.batch, seed=1)
    m = args.microbatches
    print(f"\n== stage balancing: {n // 2} dense + {n - n // 2} heavy layers (+{args.extra} "
          f"tanh passes each), 2 stages, 1f1b, m = {m} ==")
    prof = dd.profile(fn, microbatches=m, stages=2, client=client,
                      schedules=("1f1b",))(*data)
    split_x = [c.stage for c in prof.layers]
    print(f"stages=2 (XLA estimate): layers per stage {split_x}")
    print(f"XLA estimate per layer (GFLOP): "
          f"{[round(c.estimate / 1e9, 2) for c in prof.layers]}")
    print(f"measured per layer (ms):        {[round(c.seconds * 1e3, 1) for c in prof.layers]}")
    before, wb, _ = measure(client, fn, data, args.repeat, microbatches=m, schedule="1f1b",
                            stages=2)
    prof2 = dd.profile(fn, microbatches=m, stages=prof, client=client,
                       schedules=("1f1b",))(*data)
    split_p = [c.stage for c in prof2.layers]
    after, wa, _ = measure(client, fn, data, args.repeat, microbatches=m, schedule="1f1b",
                           stages=prof)
    pb, pa = dd.predict("1f1b", prof), dd.predict("1f1b", prof2)
    for label, split, spans, walls, pr, pp in (("before (stages=2)", split_x, before, wb, prof, pb),
                                               ("after (stages=prof)", split_p, after, wa, prof2,
                                                pa)):
        fb = " / ".join(f"{s.f * 1e3:.1f}+{s.b * 1e3:.1f}" for s in pr.stages)
        print(f"{label:20s} split {split}: stage F+B ms {fb}; makespan "
              f"{statistics.median(spans) * 1e3:.0f} ms (predicted {pp.makespan * 1e3:.0f}), "
              f"step {statistics.median(walls) * 1e3:.0f} ms")
    print(f"after / before: makespan {statistics.median(after) / statistics.median(before):.2f}"
          f", step {statistics.median(wa) / statistics.median(wb):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--per-stage", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extra", type=int, default=12)
    ap.add_argument("--picture", default="bench_planner_1f1b.png")
    ap.add_argument("--skip", choices=("predict", "balance"), default=None)
    ap.add_argument("--quick", action="store_true", help="256 wide, batch 128, 2 layers/stage")
    args = ap.parse_args()
    if args.quick:
        args.width, args.batch, args.per_stage, args.repeat = 256, 128, 2, 1
    cluster = dd.local_cluster(2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    try:
        if args.skip != "predict":
            predicted_vs_measured(client, args)
        if args.skip != "balance":
            balancing(client, args)
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
