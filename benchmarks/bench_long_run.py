"""Memory and speed over a long `Trainer.fit`: rounds of --steps steps, each batch new
(as a data loader gives them), on `dd.local_cluster(2)`; per round its time per step, the
client's resident memory (the scheduler runs in it) and each worker's, and how many
step programs the client and workers still hold. Flat memory is the claim: a round
should not grow what the one before left.

Zero-time stages (`dagdiff.examples.simulated`: each multiplies by a scalar), so a step is
all fixed cost and a round covers many steps; --width sets the batch's columns (64 rows:
--width 256 makes 64 KB batches).

    python benchmarks/bench_long_run.py --rounds 4 --steps 1000 --width 256
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any


def _rss_mib(dask_worker: Any = None) -> float:
    import psutil
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def _programs(dask_worker: Any = None) -> int:
    import gc as _gc
    _gc.collect()
    return sum(1 for o in _gc.get_objects() if type(o).__name__ == "Program")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000, help="steps per round")
    ap.add_argument("--width", type=int, default=256, help="batch columns (64 rows)")
    ap.add_argument("--window", default="auto", help="fit's window (default auto)")
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np
    import optax
    from distributed import Client

    import dagdiff as dd
    from dagdiff.examples.simulated import sleepy_pipeline

    window: Any = args.window if args.window == "auto" else int(args.window)
    with dd.local_cluster(2, quiet=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        rng = np.random.default_rng(0)
        trainer = dd.Trainer(sleepy_pipeline(2, 0.0), optax.adam(1e-3), microbatches=8,
                             schedule="1f1b", client=client)
        state = trainer.init([jnp.float32(1.0)] * 2)
        first: tuple[float, list[float]] | None = None
        for r in range(args.rounds):
            batches = ((rng.standard_normal((64, args.width), dtype=np.float32),)
                       for _ in range(args.steps))
            t0 = time.perf_counter()
            state, _ = trainer.fit(batches, state=state, progress=False, window=window)
            per_step = (time.perf_counter() - t0) / args.steps
            gc.collect()
            client_mib = _rss_mib()
            workers = [round(v) for v in client.run(_rss_mib).values()]
            print(f"round {r}: {1e3 * per_step:.2f} ms a step, client {client_mib:.0f} MiB, "
                  f"workers {workers} MiB, programs held: client {_programs()}, workers "
                  f"{list(client.run(_programs).values())}", flush=True)
            if r == 1:
                first = (client_mib, [float(w) for w in workers])
            if r == args.rounds - 1 and first is not None and args.rounds > 2:
                n = (args.rounds - 2) * args.steps / 1000
                grow = [(w - w0) / n for w, w0 in zip(workers, first[1])]
                print(f"growth after round 1, per 1000 steps: client "
                      f"{(client_mib - first[0]) / n:+.1f} MiB, workers "
                      f"{', '.join(f'{g:+.1f}' for g in grow)} MiB "
                      f"({args.width * 64 * 4 / 1024:.0f} KB batches)")


if __name__ == "__main__":
    main()
