"""What `dd.Trainer(clip_global_norm=c)` costs a step: the same Trainer with and without it,
in alternating rounds on one cluster.

The clip adds, per step, a sum of squares on each stage's worker, the norm on stage 0's
and its read by every stage's update (a round trip between the workers at the step's end).
The job: the tiny job by default (--width 64 --batch 64 --layers 4, 2 stages, 1F1B x
--microbatches 8, adam) on `dd.local_cluster(2)`; per round and trainer the median of
--steps `trainer.step` + `loss.result()` (after 4), and a `fit` of 4 x --steps batches
(its default windows) per step. Prints the medians over the rounds and clip / plain.

Usage: python benchmarks/bench_clip.py [--width 64] [--batch 64] [--layers 4]
       [--microbatches 8] [--steps 24] [--rounds 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import optax

import dagdiff as dd

try:
    from common import job_args, mlp_data, two_stage_loss
except ImportError:                       # run from the repository root
    from benchmarks.common import job_args, mlp_data, two_stage_loss


def main() -> None:
    from distributed import Client

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    job_args(ap, width=64, batch=64, layers=4, microbatches=8, steps=24, rounds=4)
    cfg = ap.parse_args()
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    params, data = mlp_data(cfg.width, cfg.batch, cfg.layers, batches=8)
    trainers = {
        name: dd.Trainer(two_stage_loss, optax.adam(1e-3), microbatches=cfg.microbatches,
                         schedule="1f1b", client=client, clip_global_norm=clip)
        for name, clip in (("plain", None), ("clip", 1.0))}
    states = {name: tr.init(params) for name, tr in trainers.items()}
    rows: dict[str, dict[str, list[float]]] = {n: {"step": [], "fit": []} for n in trainers}
    for r in range(cfg.rounds):
        for name, tr in trainers.items():
            times = []
            for i in range(cfg.steps + 4):
                t0 = time.perf_counter()
                states[name], loss = tr.step(states[name], *data[i % len(data)])
                loss.result()
                times.append(time.perf_counter() - t0)
            rows[name]["step"].append(statistics.median(times[4:]))
            n = 4 * cfg.steps
            t0 = time.perf_counter()
            states[name], _ = tr.fit([data[i % len(data)] for i in range(n)],
                                     state=states[name], progress=False)
            rows[name]["fit"].append((time.perf_counter() - t0) / n)
        print(f"round {r + 1}: " + ", ".join(
            f"{name} step {1e3 * rows[name]['step'][-1]:.1f} ms / fit "
            f"{1e3 * rows[name]['fit'][-1]:.1f} ms" for name in trainers), flush=True)
    print(f"\n{cfg.layers} layers x {cfg.width}, batch {cfg.batch}, 2 stages, 1F1B x "
          f"{cfg.microbatches}, adam; medians over {cfg.rounds} rounds")
    for what in ("step", "fit"):
        a = statistics.median(rows["plain"][what])
        b = statistics.median(rows["clip"][what])
        print(f"{what:5s} plain {1e3 * a:6.1f} ms  clip_global_norm {1e3 * b:6.1f} ms  "
              f"clip / plain {b / a:.2f}")
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
