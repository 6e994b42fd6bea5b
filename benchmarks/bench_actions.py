"""Where a pipelined step's time goes: each action's time in `dd.record` against the same
stage's jitted work timed alone on the same worker.

The job of bench_peers.py (8 tanh layers 1024 wide, batch 512, 2 stages, 8 microbatches,
1F1B) on `dd.local_cluster(2)`. For one recorded step (after warm-ups), per stage: the
median F and B action (compute interval logged by the worker's program) and, measured
right after on that worker with a plain `jax.jit` of the same 4-layer stage (its own
code, not dagdiff's), the forward-with-residuals (`jax.vjp`) and the pullback alone on a
microbatch, once with the other worker idle and once with both workers timing at the same
moment (in a pipelined step both compute at once and share the cores). Prints the ratio
action / alone-with-both (the issue's target: <= 1.2), the makespan and each worker's busy
time.

Usage: python benchmarks/bench_actions.py [--width 1024] [--batch 512] [--microbatches 8]
       [--steps 4] [--schedule 1f1b]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from distributed import Client, wait

import dagdiff as dd
from common import two_stage_loss as loss_fn


def alone(width: int, rows: int, last: bool, n: int = 15) -> tuple[float, float, float]:
    """Median seconds of a 4-layer stage's `jax.vjp` forward, of its pullback, and of both
    in one jitted call (what dagdiff runs for the loss's stage under 1F1B), on this worker
    (`last`: the stage that ends in the loss)."""
    rng = np.random.default_rng(0)
    ps = [{"w": jnp.asarray(rng.standard_normal((width, width), dtype=np.float32) / 32),
           "b": jnp.zeros(width, jnp.float32)} for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32))
    t = jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32))

    def stage(ps: Any, x: Any) -> Any:
        for p in ps:
            x = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.mean((x - t) ** 2) if last else x

    fwd = jax.jit(lambda ps, x: jax.vjp(stage, ps, x))
    bwd = jax.jit(lambda pb, ct: pb(ct))

    def both(ps: Any, x: Any) -> Any:
        out, pb = jax.vjp(stage, ps, x)
        return out, pb(jnp.ones_like(out))

    fused = jax.jit(both)
    fs, bs, fbs = [], [], []
    for i in range(n + 2):
        t0 = time.perf_counter()
        out, pb = jax.block_until_ready(fwd(ps, x))
        t1 = time.perf_counter()
        jax.block_until_ready(bwd(pb, jnp.ones_like(out)))
        t2 = time.perf_counter()
        jax.block_until_ready(fused(ps, x))
        t3 = time.perf_counter()
        if i >= 2:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
            fbs.append(t3 - t2)
    return statistics.median(fs), statistics.median(bs), statistics.median(fbs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    a = ap.parse_args()
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    rng = np.random.default_rng(1)
    w = a.width
    params = [{"w": jnp.asarray(rng.standard_normal((w, w), dtype=np.float32) / w ** 0.5),
               "b": jnp.zeros(w, jnp.float32)} for _ in range(8)]
    step = dd.value_and_grad(loss_fn, microbatches=a.microbatches, schedule=a.schedule)
    rec = None
    walls = []
    with client.as_current():
        for i in range(a.steps + 1):
            x = jnp.asarray(rng.standard_normal((a.batch, w), dtype=np.float32))
            t = jnp.asarray(rng.standard_normal((a.batch, w), dtype=np.float32))
            t0 = time.perf_counter()
            loss, grads = step(params, x, t)
            if i == a.steps:
                with dd.record(client) as rec:
                    futs = client.compute([loss, grads])
                    wait(futs)
            else:
                futs = client.compute([loss, grads])
                wait(futs)
            if i:
                walls.append(time.perf_counter() - t0)
            del futs
    assert rec is not None
    slots = dd.cluster.info.slot_names(client)
    rows = a.batch // a.microbatches
    print(f"{a.schedule}, {a.microbatches} microbatches of {rows} x {w}; step wall "
          f"{1e3 * statistics.median(walls):.0f} ms (median of {len(walls)})")
    acts = [r for r in rec.tasks if r.phase in ("F", "B") and r.layer != "mse"]
    span = max(r.stop for r in acts) - min(r.start for r in acts)
    print(f"schedule makespan {1e3 * span:.0f} ms (first to last F/B action)")
    order = sorted(slots.items(), key=lambda kv: kv[1])

    def time_alone(together: bool) -> dict[str, tuple[float, float, float]]:
        """`alone` on each worker: one after the other (the other worker idle), or on
        both at once (each with the other core busy, as in a pipelined step)."""
        out = {}
        futs = {}
        for addr, slot in order:
            futs[addr] = client.submit(alone, w, rows, slot == order[-1][1], workers=[addr],
                                       pure=False, resources={slot: 2 ** -20})
            if not together:
                out[addr] = futs[addr].result()
        return out or {a: f.result() for a, f in futs.items()}

    idle, both = time_alone(False), time_alone(True)
    print("alone: the same stage in plain jax.jit on that worker, the other worker idle "
          "(idle) or timing its stage at the same moment (both)")
    print(f"{'stage':>5} {'worker':>7} {'F action':>9} {'idle':>7} {'both':>7} {'ratio':>6} "
          f"{'B action':>9} {'idle':>7} {'both':>7} {'ratio':>6} {'F+B':>7} {'both':>7} "
          f"{'ratio':>6} {'busy':>6}")
    for addr, slot in order:
        stage = int(slot[4:])
        mine = [r for r in rec.tasks if r.worker == addr and r.phase in ("F", "B")]
        f = statistics.median(r.stop - r.start for r in mine if r.phase == "F")
        b = statistics.median(r.stop - r.start for r in mine if r.phase == "B")
        busy = sum(r.stop - r.start for r in rec.tasks if r.worker == addr
                   and r.phase not in ("transfer",))
        (fi, bi, _), (fb, bb, fused) = idle[addr], both[addr]
        # a stage whose F action also ran its backward (the loss's stage under 1F1B: its
        # B action only hands the cotangents on) is compared with the fused reference
        fused_here = b < 0.1 * f
        ref = fused if fused_here else fb + bb
        print(f"{stage:>5} {slot:>7} {1e3 * f:>7.1f}ms {1e3 * fi:>5.1f}ms {1e3 * fb:>5.1f}ms "
              f"{f / fb:>6.2f} {1e3 * b:>7.1f}ms {1e3 * bi:>5.1f}ms {1e3 * bb:>5.1f}ms "
              f"{b / bb:>6.2f} {1e3 * (f + b):>5.1f}ms {1e3 * ref:>5.1f}ms {(f + b) / ref:>6.2f}"
              f"{'*' if fused_here else ' '} {1e3 * busy:>4.0f}ms")
    print("ratio: action / both (the fair reference when both workers compute at once); "
          "F+B: one microbatch's forward and backward actions against the same stage alone "
          "(* the F action ran the backward too: against one jitted forward+backward)")
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
