"""Core engine overhead: dagdiff gradient step vs one jax.jit(value_and_grad), side by side.

Prints ratios (noisy shared machine: compare within one run, never across runs).
Usage: python benchmarks/bench_core.py [--layers 8] [--width 1024] [--batch 512] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import dask
import jax
import jax.numpy as jnp

import dagdiff as dd
from common import dense, mse


def loss_fn(params: Any, x: Any, t: Any) -> Any:
    h = x
    for p in params:
        h = dense(p, h)
    return mse(h, t)


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up: compile
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--trace-calls", type=int, default=10_000)
    ap.add_argument("--no-cluster", action="store_true")
    a = ap.parse_args()

    key = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (a.width, a.width))
               / a.width**0.5, "b": jnp.zeros(a.width)} for i in range(a.layers)]
    x = jax.random.normal(key, (a.batch, a.width))
    t = jax.random.normal(jax.random.fold_in(key, 99), (a.batch, a.width))

    ref = jax.jit(jax.value_and_grad(loss_fn))
    vg = dd.value_and_grad(loss_fn)

    def dagdiff_threads() -> Any:
        return dask.compute(*vg(params, x, t), scheduler="threads")

    vg_fused = dd.value_and_grad(loss_fn, fuse=True)

    def dagdiff_fused() -> Any:
        return dask.compute(*vg_fused(params, x, t), scheduler="threads")

    rows = []
    for _ in range(2):  # interleave to share the machine's noise
        t_ref = best_of(lambda: ref(params, x, t), a.repeat)
        t_dd = best_of(dagdiff_threads, a.repeat)
        t_fu = best_of(dagdiff_fused, a.repeat)
        rows.append((t_ref, t_dd, t_fu))
    t_ref = min(r[0] for r in rows)
    t_dd = min(r[1] for r in rows)
    t_fu = min(r[2] for r in rows)
    loss, grads = vg(params, x, t)
    ntasks = len(loss.__dask_graph__())
    print(f"MLP {a.layers}x{a.width}, batch {a.batch}; graph: {ntasks} tasks")
    print(f"  jax.jit(value_and_grad)      {t_ref*1e3:8.1f} ms")
    print(f"  dagdiff, threads scheduler   {t_dd*1e3:8.1f} ms   ratio {t_dd/t_ref:5.2f}  "
          "(target <= 1.10)")
    print(f"  dagdiff, threads, fuse=True    {t_fu*1e3:8.1f} ms   ratio {t_fu/t_ref:5.2f}  "
          "(one forward + one VJP task)")

    if not a.no_cluster:
        from distributed import Client

        cluster = dd.local_cluster(n_workers=1, dashboard_address=None, quiet=True,
                                   env={"XLA_FLAGS": ""})
        with Client(cluster) as client:
            def dagdiff_dist() -> Any:
                return client.compute(list(vg(params, x, t)), sync=True)
            t_dist = best_of(dagdiff_dist, a.repeat)
            t_ref2 = best_of(lambda: ref(params, x, t), a.repeat)
            print(f"  dagdiff, 1-worker LocalCluster {t_dist*1e3:6.1f} ms   ratio "
                  f"{t_dist/t_ref2:5.2f}  (includes shipping params to the worker each call)")
        cluster.close()

    # tracing cost: a 10,000-call graph of small layers
    small = [{"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}] * 8
    xs = jnp.ones((2, 4))

    def long_loss(ps: Any, x: Any) -> Any:
        h = x
        for i in range(a.trace_calls - 1):
            h = dense(ps[i % len(ps)], h)
        return mse(h, x)

    vg_long = dd.value_and_grad(long_loss)
    vg_long(small, xs)  # warm the shape cache
    t0 = time.perf_counter()
    loss, grads = vg_long(small, xs)
    dt = time.perf_counter() - t0
    print(f"tracing + building a {a.trace_calls}-call graph ({len(loss.__dask_graph__())} tasks): "
          f"{dt:.2f} s = {dt / a.trace_calls * 1e6:.0f} us per layer call (target <= 100 us)")


if __name__ == "__main__":
    main()
