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
The unequal model: 2 x --per-stage layers, the first half `dense`, the second half
"heavy" (dense followed by --extra elementwise tanh passes: work XLA's FLOP estimate
hardly sees, so ``stages=2`` splits it 4 | 4 and the second stage is slower).
Timings on a shared 2-core machine are noisy: compare within one run; the "other load"
line is the CPU (in cores) that processes outside this benchmark and its cluster used
while it measured (near 0: a quiet machine). The steps of a table are measured side by
side (round robin), so a change of load hits them alike.
Usage: python benchmarks/bench_planner.py [--width 1024] [--batch 512] [--microbatches 8]
       [--per-stage 4] [--repeat 5] [--profile-steps 2] [--extra 48]
       [--picture planner.png] [--skip predict|balance] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import psutil
from distributed import Client, wait

import dagdiff as dd
from common import dense, mse


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


class OtherLoad:
    """CPU cores used by processes other than this benchmark and its cluster (this
    process and its children) between `start` and `cores`: how quiet the machine was."""

    def start(self) -> "OtherLoad":
        self.t0, self.total0, self.ours0 = time.perf_counter(), _total_cpu(), _our_cpu()
        return self

    def cores(self) -> float:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        return max(0.0, (_total_cpu() - self.total0) - (_our_cpu() - self.ours0)) / wall


def _total_cpu() -> float:
    ct = psutil.cpu_times()
    return sum(getattr(ct, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def _our_cpu() -> float:
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            ct = proc.cpu_times()
            total += ct.user + ct.system
        except psutil.Error:
            pass
    return total


class Step:
    """One built step (``dd.value_and_grad(fn, **options)(*args)``), computed on demand:
    `run` computes it once under `dd.record` and keeps its makespan (first to last
    F/B/I/W action), its whole-step wall time and the recording."""

    def __init__(self, client: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                 **options: Any) -> None:
        self.client = client
        with client.as_current():
            self.loss, self.grads = dd.value_and_grad(fn, **options)(*args)
        self.spans: list[float] = []
        self.walls: list[float] = []
        self.rec: Any = None

    def run(self, keep: bool = True) -> None:
        t0 = time.perf_counter()
        with dd.record(self.client) as r:
            futs = self.client.compute([self.loss, *jax.tree_util.tree_leaves(self.grads)])
            with self.client.as_current():
                wait(futs)
        wall = time.perf_counter() - t0
        del futs
        if keep:
            busy = [t for t in r.tasks if t.phase in ("F", "B", "I", "W")]
            self.spans.append(max(t.stop for t in busy) - min(t.start for t in busy))
            self.walls.append(wall)
            self.rec = r


def side_by_side(steps: list[Step], repeat: int) -> float:
    """A warm-up run of each step, then `repeat` rounds running each once in turn (a load
    change on the machine hits them all alike); returns the other processes' load."""
    for st in steps:
        st.run(keep=False)
    load = OtherLoad().start()
    for _ in range(repeat):
        for st in steps:
            st.run()
    return load.cores()


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
        t0, load = time.perf_counter(), OtherLoad().start()
        prof = dd.profile(fn, microbatches=args.microbatches, stages=nstages,
                          client=client, steps=args.profile_steps)(*data)
        print(f"\nprofiled in {time.perf_counter() - t0:.1f} s (other processes used "
              f"{load.cores():.2f} cores meanwhile):\n{prof}")
        ranked = dd.best_schedule(prof, microbatches=args.microbatches)
        steps = [Step(client, fn, data, microbatches=m, schedule=name, stages=nstages)
                 for name, m, _ in ranked]
        other = side_by_side(steps, args.repeat)
        print(head)
        for (name, m, pred), st in zip(ranked, steps):
            got = statistics.median(st.spans)
            err = (pred.makespan - got) / got
            bub = st.rec.bubble_fraction().overall
            print(f"{name:16s} {nstages:6d} {pred.makespan * 1e3:8.1f}ms {got * 1e3:8.1f}ms "
                  f"{min(st.spans) * 1e3:6.1f}ms {err:+7.1%} {pred.bubble_fraction:5.1%}/"
                  f"{bub:5.1%} {max(pred.peak_live):10d} "
                  f"{statistics.median(st.walls) * 1e3:6.0f}ms", flush=True)
            rows.append((name, pred.makespan, got))
            if args.picture and name == "1f1b":
                pred.timeline(st.rec, path=args.picture)
                print(f"   (picture: {args.picture})")
        print(f"(measured side by side, {args.repeat} rounds; other processes used "
              f"{other:.2f} cores meanwhile)")
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
    prof = dd.profile(fn, microbatches=m, stages=2, client=client, schedules=("1f1b",),
                      steps=args.profile_steps)(*data)
    print(f"XLA estimate per layer (GFLOP): "
          f"{[round(c.estimate / 1e9, 2) for c in prof.layers]}")
    print(f"measured per layer (ms):        {[round(c.seconds * 1e3, 1) for c in prof.layers]}")
    prof2 = dd.profile(fn, microbatches=m, stages=prof, client=client, schedules=("1f1b",),
                       steps=args.profile_steps)(*data)
    steps = [Step(client, fn, data, microbatches=m, schedule="1f1b", stages=2),
             Step(client, fn, data, microbatches=m, schedule="1f1b", stages=prof)]
    other = side_by_side(steps, args.repeat)
    for label, pr, st in (("before (stages=2)", prof, steps[0]),
                          ("after (stages=prof)", prof2, steps[1])):
        fb = " / ".join(f"{s.f * 1e3:.1f}+{s.b * 1e3:.1f}" for s in pr.stages)
        print(f"{label:20s} split {[c.stage for c in pr.layers]}: stage F+B ms {fb}; makespan "
              f"{statistics.median(st.spans) * 1e3:.0f} ms (predicted "
              f"{dd.predict('1f1b', pr).makespan * 1e3:.0f}), step "
              f"{statistics.median(st.walls) * 1e3:.0f} ms")
    b, a = steps
    print(f"after / before: makespan {statistics.median(a.spans) / statistics.median(b.spans):.2f}"
          f", step {statistics.median(a.walls) / statistics.median(b.walls):.2f} (side by side, "
          f"{args.repeat} rounds; other processes used {other:.2f} cores meanwhile)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--per-stage", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--extra", type=int, default=48)
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
