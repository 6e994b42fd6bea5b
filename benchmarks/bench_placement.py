"""Stage placement overhead: a 2-stage MLP on a 2-worker cluster vs 1 worker vs one jax.jit.

Prints, per width, the step time of each mode, its ratio to monolithic JAX and the tasks
per step, with and without fusion; then the smallest width at which the 2-worker fused
pipeline is within 10% of monolithic JAX. Ratios only: the machine is shared and noisy.
Usage: python benchmarks/bench_placement.py [--widths 256 512 1024 2048] [--layers 8]
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
from common import dense, mse


def loss_fn(params: Any, x: Any, t: Any) -> Any:
    h = x
    half = len(params) // 2
    for i, p in enumerate(params):
        with dd.stage(0 if i < half else 1):
            h = dense(p, h)
    with dd.stage(1):
        return mse(h, t)


def timed(fn: Callable[[int], Any], repeat: int) -> float:
    """Median time of fn(i) for i = 1..repeat after a warm-up fn(0) (compiles)."""
    fn(0)
    ts = []
    for i in range(1, repeat + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(i))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True,
                               env={"XLA_FLAGS": ""})
    client = Client(cluster)
    print(f"{a.layers} dense layers in 2 stages, batch {a.batch}; median of {a.repeat}")
    print(f"{'width':>6} {'jit ms':>8} | {'mode':<22} {'ms':>8} {'ratio':>6} {'tasks':>6}")
    within = None
    for w in a.widths:
        key = jax.random.PRNGKey(0)
        params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (w, w)) / w**0.5,
                   "b": jnp.zeros(w)} for i in range(a.layers)]
        x = jax.random.normal(key, (a.batch, w))
        t = jax.random.normal(jax.random.fold_in(key, 1), (a.batch, w))
        ref = jax.jit(jax.value_and_grad(loss_fn))
        xs = [x + 1e-3 * i for i in range(a.repeat + 1)]   # fresh data: fresh task keys
        t_ref = timed(lambda i: ref(params, xs[i], t), a.repeat)
        rows = []
        for fuse in (False, True):
            for label, placement in (("1 worker", {0: 0, 1: 0}), ("2 workers", None)):
                vg = dd.value_and_grad(loss_fn, fuse=fuse, placement=placement)
                with client.as_current():
                    loss, grads = vg(params, x, t)
                    ntasks = len(loss.__dask_graph__())

                    def step(i: int) -> Any:
                        # grads stay on the workers (as in training); only the loss returns
                        loss, grads = vg(params, xs[i], t)
                        futs = client.persist([loss, *jax.tree_util.tree_leaves(grads)])
                        wait(futs)                  # forward and backward done
                        return futs[0].result()
                    dt = timed(step, a.repeat)
                rows.append((f"{label}{', fused' if fuse else ''}", dt, ntasks))
                if fuse and placement is None and within is None and dt / t_ref <= 1.10:
                    within = w
        for i, (label, dt, n) in enumerate(rows):
            head = f"{w:>6} {t_ref*1e3:>8.1f}" if i == 0 else " " * 15
            print(f"{head} | {label:<22} {dt*1e3:>8.1f} {dt/t_ref:>6.2f} {n:>6}")
    print(f"2-worker fused pipeline within 10% of monolithic JAX from width: {within}")
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
