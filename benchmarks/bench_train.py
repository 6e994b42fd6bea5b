"""Trainer throughput: steps/s of dd.Trainer.step vs a plain jax.jit + optax step on the same
model and data, and 2 replicas vs 1 (with the all-reduce's share of the step).
Ratios only (noisy shared machine).
Usage: python benchmarks/bench_train.py [--width 512] [--steps 10]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from distributed import Client

import dagdiff as dd
from common import two_stage_loss as loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    key = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (a.width, a.width))
               / a.width**0.5, "b": jnp.zeros(a.width)} for i in range(a.layers)]
    batches = [(jax.random.normal(jax.random.fold_in(key, 10 + i), (a.batch, a.width)),
                jax.random.normal(jax.random.fold_in(key, 99 + i), (a.batch, a.width)))
               for i in range(a.steps + 1)]
    opt = optax.adam(1e-3)

    @jax.jit
    def step(p: Any, s: Any, x: Any, t: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, x, t)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p, s = params, opt.init(params)
    p, s, _ = step(p, s, *batches[0])
    t0 = time.perf_counter()
    for b in batches[1:]:
        p, s, loss = step(p, s, *b)
    jax.block_until_ready(loss)
    t_jit = (time.perf_counter() - t0) / a.steps
    print(f"MLP {a.layers}x{a.width}, batch {a.batch}, {a.steps} steps, adam")
    print(f"  jax.jit + optax (1 process)        {1 / t_jit:7.2f} steps/s")
    cluster = dd.local_cluster(n_workers=4, dashboard_address=None, quiet=True,
                               env={"XLA_FLAGS": ""})
    client = Client(cluster)
    rates = {}
    for replicas in (1, 2):
        tr = dd.Trainer(loss_fn, opt, microbatches=a.microbatches, schedule="1f1b",
                        replicas=replicas, client=client)
        state = tr.init(params, *batches[0])
        state, loss = tr.step(state, *batches[0])
        loss.result()                                            # compile on the workers
        t0 = time.perf_counter()
        for b in batches[1:]:
            state, loss = tr.step(state, *b)
        loss.result()
        rates[replicas] = a.steps / (time.perf_counter() - t0)
        with dd.record(client) as rec:
            state, loss = tr.step(state, *batches[0])
            loss.result()
        share = sum(t.stop - t.start for t in rec.tasks if t.phase in ("reduce",)) / max(
            sum(t.stop - t.start for t in rec.tasks if t.phase != "transfer"), 1e-9)
        print(f"  dd.Trainer, 1F1B x{a.microbatches}, {replicas} replica(s) on "
              f"{2 * replicas} workers {rates[replicas]:7.2f} steps/s  "
              f"(ratio to jit {rates[replicas] * t_jit:.2f}; all-reduce {share:.1%} of task time)")
    print(f"  2 replicas vs 1: {rates[2] / rates[1]:.2f}x steps/s (each replica gets half "
          "the batch)")
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
