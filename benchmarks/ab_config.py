"""One boolean dask config key on and off, in alternating blocks of `Trainer.step` on one
cluster: the step's wall time and its programs' own time on the workers.

A single step's wall time on this project's 2-core machine spreads by more than a change of
a few hundred microseconds in the programs; the programs' time (each ``prog_slot`` task's
compute span in distributed's task stream) leaves out the client, the scheduler and the
event loops, so it shows such a change. The job: two zero-time stages (`--zero` of
`bench_fixed_cost.py`: `dagdiff.examples.simulated.sleepy_pipeline(2, 0)`, each stage
multiplies by a scalar parameter), batch 64 x 64, 1F1B x 8, sgd, on `dd.local_cluster(2)`.
Per round, `--steps` steps with the key on (set on the client and every worker), then
`--steps` with it off; printed: the running medians of both modes after each round, then
on / off. A step is `state, loss = trainer.step(state, x); loss.result()`.

Usage: python benchmarks/ab_config.py [--key dagdiff.direct.lanes] [--rounds 6]
       [--steps 30]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import dask
import jax
import optax

import dagdiff as dd


def _configure(settings: dict[str, Any]) -> None:
    """On a worker: dask config for the programs that start from now on."""
    dask.config.set(settings)


def _program_seconds(records: list[dict[str, Any]]) -> list[float]:
    out = []
    for rec in records:
        if str(rec["key"]).startswith("prog"):
            spans = [s for s in rec["startstops"] if s["action"] == "compute"]
            if spans:
                out.append(spans[0]["stop"] - spans[0]["start"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--key", default="dagdiff.direct.lanes")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    cfg = ap.parse_args()
    import jax.numpy as jnp
    from distributed import Client, get_task_stream

    from dagdiff.examples.simulated import sleepy_pipeline

    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    xs = [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) for i in range(4)]
    trainer = dd.Trainer(sleepy_pipeline(2, 0.0), optax.sgd(1e-3), microbatches=8,
                         schedule="1f1b")
    state = trainer.init([jnp.float32(1.0)] * 2)
    for i in range(10):                                   # compile, warm up
        state, loss = trainer.step(state, xs[i % 4])
        loss.result()
    got: dict[bool, dict[str, list[float]]] = {m: {"programs": [], "step": []}
                                               for m in (True, False)}
    default = dask.config.get(cfg.key, True)
    try:
        for r in range(cfg.rounds):
            for mode in (True, False):
                client.run(_configure, {cfg.key: mode})
                with dask.config.set({cfg.key: mode}), get_task_stream(client) as ts:
                    for i in range(cfg.steps):
                        t0 = time.perf_counter()
                        state, loss = trainer.step(state, xs[i % 4])
                        loss.result()
                        got[mode]["step"].append(time.perf_counter() - t0)
                    time.sleep(0.5)                       # the last step's records
                got[mode]["programs"] += _program_seconds(ts.data)
            print(f"round {r + 1}: " + ", ".join(
                f"{k} {1e3 * statistics.median(got[True][k]):.2f} / "
                f"{1e3 * statistics.median(got[False][k]):.2f} ms" for k in got[True]),
                flush=True)
    finally:
        client.run(_configure, {cfg.key: default})
        client.close()
        cluster.close()
    print(f"\n{cfg.key} on / off, Trainer.step on two zero-time stages, 1F1B x 8; medians "
          f"of {cfg.rounds} x {cfg.steps} steps each")
    for k in got[True]:
        a, b = statistics.median(got[True][k]), statistics.median(got[False][k])
        print(f"  {k:9s} {1e3 * a:7.2f} ms  {1e3 * b:7.2f} ms  on / off {a / b:.2f}")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
