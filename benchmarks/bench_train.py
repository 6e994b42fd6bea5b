"""Trainer throughput: steps/s of dd.Trainer.step vs a plain jax.jit + optax step on the same
model and data, and 2 replicas vs 1 (with the all-reduce's share of the step); then what
fault tolerance costs: recover=True (the default: a copy of each stage's state sent to
another worker once 10 steps and copy_seconds() have passed since the last) and recover=True with a
copy after every step (what one copy costs) against recover=False, interleaved, and the
time from a SIGKILLed worker to the end of the retried step.
Ratios only (noisy shared machine).
Usage: python benchmarks/bench_train.py [--width 512] [--steps 10] [--rounds 8]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from distributed import Client

import dagdiff as dd
from common import job_args
from common import two_stage_loss as loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    # --rounds: recover=True / recover=False rounds, interleaved
    job_args(ap, width=512, layers=4, batch=256, steps=10, microbatches=4, rounds=8)
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
    recovery_cost(client, params, batches, opt, a)
    client.close()
    cluster.close()


def _fit_time(client: Any, params: Any, batches: list[Any], opt: Any, a: Any,
              recover: bool, **kw: Any) -> float:
    tr = dd.Trainer(loss_fn, opt, microbatches=a.microbatches, schedule="1f1b",
                    client=client, recover=recover, **kw)
    state, _ = tr.fit(batches[:2], params=params, progress=False)    # compile, place
    t0 = time.perf_counter()
    tr.fit(batches, state=state, progress=False)
    return (time.perf_counter() - t0) / len(batches)


def recovery_cost(client: Any, params: Any, batches: list[Any], opt: Any, a: Any) -> None:
    """recover=True vs recover=False on 1 replica (the case that pays for copies), and the
    time from a kill to the retried step's end."""
    modes = {"off": dict(recover=False), "on": dict(recover=True),
             "every step": dict(recover=True, copy_every=1, copy_interval=0)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m, kw in modes.items():
            times[m].append(_fit_time(client, params, batches, opt, a, **kw))
    off, on, every = (statistics.median(times[m]) for m in modes)
    d = dd.Trainer(loss_fn, opt)
    d.init(params)
    print(f"  fault tolerance, 1 replica: step {on * 1e3:.1f} ms with recover=True (a copy "
          f"of every stage's state once {d.copy_every} steps and {d.copy_seconds():.2f} s have "
          f"passed) vs {off * 1e3:.1f} ms with recover=False: {on / off - 1:+.1%}; a copy "
          f"after every step: {every * 1e3:.1f} ms ({every / off - 1:+.1%}, i.e. "
          f"~{(every - off) * 1e3:.0f} ms per copy) (medians of {a.rounds} interleaved fits "
          f"of {len(batches)} steps)")
    tr = dd.Trainer(loss_fn, opt, microbatches=a.microbatches, schedule="1f1b", client=client)
    state, _ = tr.fit(batches[:2], params=params, progress=False)
    killed: list[float] = []

    def kill() -> None:
        deadline = time.time() + 10
        while time.time() < deadline and not any(client.run(_running).values()):
            time.sleep(0.005)
        pids = client.run(os.getpid)
        victim = next(a for a, slot in dd.cluster.info.slot_names(client).items()
                      if slot == "slot1")            # stage 1's worker
        killed.append(time.time())
        os.kill(pids[victim], signal.SIGKILL)

    thread = threading.Thread(target=kill)
    thread.start()
    tr.fit(batches * 3, state=state, progress=False)
    thread.join()
    for rec in tr.recoveries:
        end = rec.failed_at + rec.seconds
        print(f"  a worker SIGKILLed mid-step: step {rec.step} failed "
              f"{rec.failed_at - killed[0]:.1f} s after the kill and its retry ended "
              f"{end - killed[0]:.1f} s after it ({rec.seconds:.1f} s of recovery: "
              f"{', '.join(f'stage {s} on {to}' for s, _, to in rec.moved) or 'no stage moved'}, "
              f"{len(rec.restored)} value(s) restored from a copy, {rec.replayed} step(s) "
              "run again)")
    if not tr.recoveries:
        print("  (the kill did not hit a step: no recovery)")


def _running(dask_worker: Any) -> int:
    return len(dask_worker.extensions["dagdiff"]._running)


if __name__ == "__main__":
    main()
