"""`Trainer.fit` in windows, with and without replicas: the time per step of `fit` with
window=1, window="auto" (its default), window=8 and window=16, in alternating rounds on one
`dd.local_cluster(2 * replicas)`, and the window "auto" chose (read from its log: on the
warm-up fit; the Trainer keeps the choice, so the timed fits start with it).

The job: the issue's tiny job by default (--width 64 --batch 64 --layers 4, 2 stages,
1F1B x --microbatches 8, optax.adam), replicas 1 (2 workers' worth of stages on the
cluster) and 2 (data-parallel: 4 workers); each fit runs --steps steps after a warm-up
fit. This compares dagdiff with itself (the peers' figures are `bench_peers.py`'s rows
dagdiff-fit, dagdiff-fit8 and dagdiff-fitauto against torch + Adam, for one replica).
Usage: python benchmarks/bench_windows.py [--width 64] [--batch 64] [--layers 4]
       [--microbatches 8] [--steps 40] [--rounds 3] [--replicas 1 2]
"""
from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import optax
from distributed import Client

import dagdiff as dd

try:
    from common import job_args, mean_seconds, mlp_data, two_stage_loss
except ImportError:                       # run from the repository root
    from benchmarks.common import job_args, mean_seconds, mlp_data, two_stage_loss

WINDOWS: tuple[int | str, ...] = (1, "auto", 8, 16)


class Chosen(logging.Handler):
    """The windows `fit`'s AutoWindow chose (its info log line)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sizes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "window=" in record.getMessage():
            self.sizes.append(int(record.getMessage().rsplit("window=", 1)[1]))


def main() -> None:
    ap = job_args(argparse.ArgumentParser(description=__doc__), width=64, batch=64, layers=4,
                  microbatches=8, steps=40, rounds=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    chosen = Chosen()
    log = logging.getLogger("dagdiff.train.fit")
    log.addHandler(chosen)
    log.setLevel(logging.INFO)
    params, data = mlp_data(a.width, a.batch, a.layers, batches=8)
    batches = [data[i % len(data)] for i in range(a.steps)]
    print(f"MLP {a.layers} x {a.width} tanh, batch {a.batch}, 2 stages, 1F1B x "
          f"{a.microbatches}, adam; {a.steps} steps per fit, {a.rounds} rounds")
    for replicas in a.replicas:
        with dd.local_cluster(2 * replicas) as cluster, Client(cluster) as client:
            tr = dd.Trainer(two_stage_loss, optax.adam(1e-3), microbatches=a.microbatches,
                            schedule="1f1b", replicas=replicas, client=client)
            state, _ = tr.fit(batches[:8], params=params, progress=False, window=1)
            for w in WINDOWS[1:]:
                tr.fit(batches[:16], state=state, progress=False, window=w)     # warm
            times: dict[Any, list[float]] = {w: [] for w in WINDOWS}
            for r in range(a.rounds):
                for w in (WINDOWS if r % 2 == 0 else WINDOWS[::-1]):
                    times[w] += mean_seconds(lambda: tr.fit(batches, state=state,
                                                            progress=False, window=w),
                                             a.steps)
            med = {w: statistics.median(v) for w, v in times.items()}
            print(f"replicas={replicas} ({2 * replicas} workers): ms per step " + ", ".join(
                f"window={w} {1e3 * med[w]:.1f} [{', '.join(f'{1e3 * x:.1f}' for x in v)}]"
                for w, v in times.items()))
            print(f"  auto chose window {sorted(set(chosen.sizes))}; auto / window=1 "
                  f"{med['auto'] / med[1]:.2f}, window=8 / window=1 {med[8] / med[1]:.2f}, "
                  f"window=16 / window=1 {med[16] / med[1]:.2f}")
            chosen.sizes.clear()


if __name__ == "__main__":
    main()
