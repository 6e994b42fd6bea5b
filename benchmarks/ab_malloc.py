"""What the workers' glibc malloc variables cost or save, two clusters side by side.

Two 2-worker `dd.local_cluster`s run at once, each with its own `WORKER_MALLOC_ENV` (the
variables a nanny gives its worker before it starts, beside distributed's
MALLOC_TRIM_THRESHOLD_=65536): `toppad` = MALLOC_TOP_PAD_=64 MiB alone (dd.local_cluster
before 2026-12-01 evening), `default` = dd.local_cluster's (top pad + MALLOC_MMAP_THRESHOLD_
=32 MiB). In alternating rounds (A, B, A, B, ...) each runs `--steps` value_and_grad steps
and `--steps` Trainer + adam steps of the bench_peers.py job (8 tanh layers 1024 wide,
batch 512, 2 stages, 8 microbatches, 1F1B); prints each round's ratios, the median step
of each, the median of the rounds' ratios and each worker's RSS (peak). The idle cluster
waits while the other runs: on a noisy shared machine this is fairer than two invocations
an hour apart.
Usage: python benchmarks/ab_malloc.py [--rounds 6] [--steps 4] [--width 1024]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from distributed import Client, wait

import dagdiff as dd
import dagdiff.cluster.local as ddc
from common import two_stage_loss


def _memory() -> tuple[int, int, str | None]:
    import os

    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f if ":" in line)
    return (int(st["VmRSS"].split()[0]) // 1024, int(st["VmHWM"].split()[0]) // 1024,
            os.environ.get("MALLOC_MMAP_THRESHOLD_"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="per round and kind (first: warm-up)")
    ap.add_argument("--width", type=int, default=1024)
    a = ap.parse_args()
    envs = {"toppad": {"MALLOC_TOP_PAD_": str(64 << 20)}, "default": dict(ddc.WORKER_MALLOC_ENV)}
    clusters: dict[str, tuple[Any, Any]] = {}
    try:
        for name, env in envs.items():
            ddc.WORKER_MALLOC_ENV = env          # read by the nannies as they start
            cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
            clusters[name] = (cluster, Client(cluster, set_as_default=False))
        ddc.WORKER_MALLOC_ENV = envs["default"]
        rng = np.random.default_rng(1)
        w = a.width
        params = [{"w": jnp.asarray(rng.standard_normal((w, w), dtype=np.float32) / w ** 0.5),
                   "b": jnp.zeros(w, jnp.float32)} for _ in range(8)]
        batches = [(jnp.asarray(rng.standard_normal((512, w), dtype=np.float32)),
                    jnp.asarray(rng.standard_normal((512, w), dtype=np.float32)))
                   for _ in range(a.steps)]
        step = dd.value_and_grad(two_stage_loss, microbatches=8, schedule="1f1b")
        trainers = {n: dd.Trainer(two_stage_loss, optax.adam(1e-3), microbatches=8,
                                  schedule="1f1b", client=c) for n, (_, c) in clusters.items()}
        states = {n: trainers[n].init(params, *batches[0]) for n in envs}
        vg: dict[str, list[float]] = {n: [] for n in envs}
        tr: dict[str, list[float]] = {n: [] for n in envs}
        per_round: list[tuple[float, float]] = []      # (value_and_grad, Trainer) B / A
        for r in range(a.rounds):
            for n, (_, client) in clusters.items():
                with client.as_current():
                    for i, (x, t) in enumerate(batches):
                        t0 = time.perf_counter()
                        loss, grads = step(params, x, t)
                        futs = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
                        futs[0].result()
                        wait(futs)
                        del futs
                        if i:
                            vg[n].append(time.perf_counter() - t0)
                for i, (x, t) in enumerate(batches):
                    t0 = time.perf_counter()
                    states[n], loss = trainers[n].step(states[n], x, t)
                    loss.result()
                    if i:
                        tr[n].append(time.perf_counter() - t0)
            k = a.steps - 1
            per_round.append(tuple(statistics.median(d["default"][-k:])  # type: ignore[misc]
                                   / statistics.median(d["toppad"][-k:]) for d in (vg, tr)))
            print(f"  round {r}: default / toppad value_and_grad {per_round[-1][0]:.2f}, "
                  f"Trainer {per_round[-1][1]:.2f}", flush=True)
        for n, (_, client) in clusters.items():
            mem = ", ".join(f"{r} MB (peak {p})" for r, p, _ in client.run(_memory).values())
            print(f"{n:<8} {envs[n]}: value_and_grad {statistics.median(vg[n]) * 1e3:.1f} ms, "
                  f"Trainer + adam {statistics.median(tr[n]) * 1e3:.1f} ms ({len(vg[n])} steps "
                  f"each); workers' RSS {mem}")
        print(f"default / toppad (median of the rounds' ratios): value_and_grad "
              f"{statistics.median(x for x, _ in per_round):.2f}, Trainer "
              f"{statistics.median(y for _, y in per_round):.2f}")
        del states
    finally:
        for cluster, client in clusters.values():
            client.close()
            cluster.close()


if __name__ == "__main__":
    main()
