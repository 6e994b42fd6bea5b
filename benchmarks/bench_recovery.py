"""Recovery under repeated kills: a `Trainer.fit` of --steps steps on dd.local_cluster(4)
(2 stages, 1F1B x4) undisturbed and with --kills SIGKILLs spread over it (a random worker
each time, not waiting for replacements), alternating, for replicas 1 and 2. Prints the
time from each kill to the end of its retried step (median, max; from `trainer.recoveries`,
whose failed_at is when the failure reached the trainer), the extra wall time of the
disturbed fit, and whether its parameters equal the undisturbed run's.
Usage: python benchmarks/bench_recovery.py [--steps 150] [--kills 5] [--every 1.5]
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import optax
from distributed import Client

import dagdiff as dd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.test_recovery import loss_fn, make_data  # noqa: E402  (the suite's model)


def killer(client: Any, kills: int, every: float, seed: int, out: list[float],
           stop: threading.Event) -> None:
    rng = random.Random(seed)
    for _ in range(kills):
        if stop.wait(rng.uniform(0.5 * every, 1.5 * every)):
            return
        slots = dd.cluster.info.slot_names(client)
        if len(slots) < 2:
            continue
        addr = rng.choice(sorted(slots))
        try:
            pid = client.run(os.getpid, workers=[addr])[addr]
        except Exception:                  # noqa: BLE001 - it just went away
            continue
        os.kill(pid, signal.SIGKILL)
        out.append(time.time())
        print(f"  killed {slots[addr]} ({addr})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--every", type=float, default=1.5, help="mean seconds between kills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    cluster = dd.local_cluster(n_workers=4, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    params, batches = make_data(a.steps)
    for replicas in a.replicas:
        opt = optax.sgd(0.05)
        ref = dd.Trainer(loss_fn, opt, microbatches=4, schedule="1f1b", replicas=replicas,
                         client=client)
        ref.fit(batches[:2], params=params, progress=False)          # warm
        t0 = time.perf_counter()
        s0, _ = ref.fit(batches, params=params, progress=False)
        calm = time.perf_counter() - t0
        want = jax.tree_util.tree_leaves(ref.params(s0))   # before kills can take it
        tr = dd.Trainer(loss_fn, opt, microbatches=4, schedule="1f1b", replicas=replicas,
                        client=client)
        tr.fit(batches[:2], params=params, progress=False)
        kills: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=killer,
                              args=(client, a.kills, a.every, a.seed, kills, stop))
        t0 = time.perf_counter()
        th.start()
        try:
            s1, _ = tr.fit(batches, params=params, progress=False)
        except dd.LostStateError as e:        # both copies of a state lost
            stop.set()
            th.join()
            print(f"replicas={replicas}: LostStateError after {len(kills)} kills "
                  f"({len(tr.recoveries)} recoveries before it): {e}", flush=True)
            client.wait_for_workers(4, timeout=120)
            continue
        hit = time.perf_counter() - t0
        stop.set()
        th.join()
        try:
            s1 = tr.recover(s1)              # a kill right after the fit's end
        except dd.LostStateError as e:
            print(f"replicas={replicas}: the final state was lost after the fit: {e}")
            continue
        equal = all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
                    for x, y in zip(jax.tree_util.tree_leaves(tr.params(s1)), want))
        # kill -> its retried step's end: the newest kill before each failure
        spans = []
        for r in tr.recoveries:
            before = [k for k in kills if k <= r.failed_at + 0.05]
            if before:
                spans.append(r.failed_at - before[-1] + r.seconds)
        med = statistics.median(spans) if spans else float("nan")
        print(f"replicas={replicas}: {len(kills)} kills in the fit, {len(tr.recoveries)} "
              f"recoveries; kill -> retried step done median {med:.2f} s, max "
              f"{max(spans, default=float('nan')):.2f} s; fit {hit:.2f} s vs undisturbed "
              f"{calm:.2f} s (+{hit - calm:.2f} s); moved "
              f"{sorted({m for r in tr.recoveries for m in r.moved})}; equal: {equal}",
              flush=True)
        client.wait_for_workers(4, timeout=120)
        time.sleep(2)
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
