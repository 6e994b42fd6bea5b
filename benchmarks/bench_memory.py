"""Memory as a planned resource, side by side in one run on a 2-worker local cluster.

A two-stage MLP under 1F1B whose activations dominate its parameters. The limit is set
below what 1F1B without recomputation measurably holds on its first worker; the planner
(`dd.best_schedule(profile, memory_limit=...)`) picks a policy per stage, and the plan
is run and measured next to no recomputation and full recomputation everywhere (the
policy a user would otherwise pick). Prints, per run: the measured peak per worker
(`dd.record(...).peak_memory()`), the predicted one, the median step time, and whether
the gradients equal `jax.value_and_grad`'s. Then the estimate against the measurement
for every built-in schedule (`--all-schedules`).

    python benchmarks/bench_memory.py [--width 256 --batch 4096 --layers 8 --steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from distributed import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dagdiff as dd  # noqa: E402
from common import mlp_data, two_stage_loss  # noqa: E402

MiB = 2**20


def run(client: Any, loss: Any, args: tuple[Any, ...], schedule: Any, m: int, remat: Any,
        steps: int) -> tuple[dict[str, int], float, Any]:
    """Measured peak per slot, median step seconds and the last (loss, grads)."""
    step = dd.value_and_grad(loss, microbatches=m, schedule=schedule, remat=remat)
    out = step.compute(*args, client=client)                 # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step.compute(*args, client=client)
        times.append(time.perf_counter() - t0)
    with dd.record(client) as rec:
        out = step.compute(*args, client=client)
    peaks = {rec.worker_names.get(w, w): n for w, n in rec.peak_memory().items()}
    return peaks, statistics.median(times), out


def equal_to_jax(loss: Any, args: tuple[Any, ...], out: Any) -> bool:
    want_l, want_g = jax.value_and_grad(loss)(*args)
    got_l, got_g = out
    ok = np.allclose(got_l, want_l, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g)):
        ok = ok and np.allclose(a, b, rtol=1e-4, atol=1e-6)
    return bool(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all-schedules", action="store_true")
    a = ap.parse_args()
    params, data = mlp_data(a.width, a.batch, a.layers, batches=1)
    args = (params, *data[0])
    loss = two_stage_loss
    m = a.microbatches
    cluster = dd.local_cluster(2, quiet=True, dashboard_address=None)
    client = Client(cluster)
    try:
        prof = dd.profile(loss, microbatches=m, schedules=["1f1b"], client=client)(*args)
        plain, t_plain, out_plain = run(client, loss, args, "1f1b", m, "none", a.steps)
        limit = int(0.92 * plain["slot0"])
        print(f"job: {a.layers} tanh layers {a.width} wide, batch {a.batch}, 2 stages, "
              f"1F1B x{m}; limit {limit / MiB:.2f} MiB per worker (92% of the first "
              "worker's measured peak without recomputation)\n")
        _, _, plan = dd.best_schedule(prof, memory_limit=limit, schedules=["1f1b"])[0]
        rows = []
        for label, remat in (("none", "none"), ("plan " + str(plan.remat), plan.remat),
                             ("full everywhere", "full")):
            if remat == "none":
                peaks, t, out = plain, t_plain, out_plain
            else:
                peaks, t, out = run(client, loss, args, "1f1b", m, remat, a.steps)
            pred = dd.predict("1f1b", prof, m, remat=remat)
            fits = all(v <= limit for v in peaks.values())
            rows.append((label, peaks, pred.memory, t, fits, equal_to_jax(loss, args, out)))
        print(f"{'remat':34s} {'measured MiB (w0, w1)':>22s} {'predicted MiB':>16s} "
              f"{'step ms':>8s} {'fits':>5s} {'grads = jax':>11s}")
        for label, peaks, pred_mem, t, fits, ok in rows:
            meas = f"{peaks['slot0'] / MiB:.2f}, {peaks['slot1'] / MiB:.2f}"
            pr = f"{pred_mem[0] / MiB:.2f}, {pred_mem[1] / MiB:.2f}"
            print(f"{label:34s} {meas:>22s} {pr:>16s} {t * 1e3:8.1f} {str(fits):>5s} "
                  f"{str(ok):>11s}")
        t_plan, t_full = rows[1][3], rows[2][3]
        print(f"\nplan / full recomputation step time: {t_plan / t_full:.2f}x")
        if a.all_schedules:
            estimates(client, params, data[0], m)
    finally:
        client.close()
        cluster.close()


def estimates(client: Any, params: Any, batch: Any, m: int) -> None:
    """Predicted (the trace's footprint over the schedule's order) against measured peaks,
    every built-in schedule, 2 workers (two stages each for the multi-chunk ones)."""
    from dagdiff.build import Options, trace_model
    from dagdiff.core.footprint import stage_footprints
    from dagdiff.lowering.memory import loss_fused, step_memory
    from dagdiff.schedules import SCHEDULES

    from common import dense, mse

    def staged(n: int) -> Any:
        def loss(ps: Any, x: Any, t: Any) -> Any:
            h = x
            for i, p in enumerate(ps):
                with dd.stage(i * n // len(ps)):
                    h = dense(p, h)
            with dd.stage(n - 1):
                return mse(h, t)
        return loss

    print(f"\n{'schedule':16s} {'remat':10s} {'w0 measured / predicted':>26s} "
          f"{'w1 measured / predicted':>26s}")
    for name in SCHEDULES:
        multi = name in ("interleaved", "looped-bfs", "interleaved-zb")
        sched = dd.get_schedule(name, virtual_stages=2) if multi else dd.get_schedule(name)
        loss = staged(2 * sched.virtual_stages)
        args = (params, *batch)
        for remat in ("none", "full"):
            peaks, _, _ = run(client, loss, args, sched, m, remat, 0)
            model = trace_model(loss, args, {}, Options.make(
                "bench", microbatches=m, schedule=sched, remat=remat), None)
            fps = stage_footprints(model.trace, current=remat)
            pred = step_memory(fps, sched, 2, m, remat,
                               loss_fused(model.trace, sched, m, model.trace.num_stages - 1))
            cells = [f"{peaks[f'slot{w}'] / MiB:.2f} / {pred[w].bytes / MiB:.2f} "
                     f"({(pred[w].bytes - peaks[f'slot{w}']) / peaks[f'slot{w}']:+.0%})"
                     for w in range(2)]
            print(f"{name:16s} {remat:10s} {cells[0]:>26s} {cells[1]:>26s}")


if __name__ == "__main__":
    jnp.zeros(1).block_until_ready()
    main()
