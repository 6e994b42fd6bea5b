"""A step's fixed cost: where the time of a step with (almost) no compute goes, with step
templates (compile once, run many) against lowering every step, on one cluster in turns.

The job: the issue's tiny job by default (--width 64 --batch 64 --layers 4, 2 stages,
1F1B x --microbatches 8) on `dd.local_cluster(2)`. For each mode, in alternating rounds
(A, B, A, B, ...; dask config ``dagdiff.step-templates`` on / off), the median of --steps
steps of:
  value_and_grad  trace + build (`step(params, x, t)`), submit (`client.compute` of the
                  loss and every gradient leaf), and the wait for them: the three parts and
                  the whole step;
  trainer.step    `state, loss = trainer.step(state, x, t); loss.result()` (sgd);
  fit             `trainer.fit` over --steps batches (two steps in flight, its default
                  window="auto"): per step.
Then the ratio templates / lowering of each, and the client's time in the cyclic garbage
collector per step. A real job's compute adds to the wait only.

--zero: the job is two zero-time stages instead (`dagdiff.examples.simulated`'s stages
with no sleep: each multiplies by a scalar parameter), the issue's "fixed cost with
zero-time stages"; --batch and --width give the input's shape.

--switch KEY: alternate another boolean dask config key instead (set on the client and on
every worker before each round), e.g. ``dagdiff.direct.lanes``.

--floor: instead, Dask's own cost of a step's graph: in alternating rounds on the same
cluster, dagdiff's `value_and_grad` step and `Trainer.step` (sgd) against plain Dask graphs
of the same shape whose tasks do nothing (one "program" task per worker, then a gradient
output per parameter leaf + the loss, each waiting for both programs; for the Trainer, the
loss + one pick per stage, the programs reading the previous step's picks), pinned to the
same workers and submitted as dagdiff submits (`Client.get`), and one no-op task's round
trip (`client.submit(f).result()`): what any design that submits a step as this Dask graph
pays here.

--scale P:M [P:M ...]: instead, per (p, m), on an in-process cluster of p workers with
zero-time sleep stages (`dagdiff.examples.simulated`, so this measures building and dispatch
only): the first build (trace + lower + rewrite), its run, and a later step's build from
the template (new batch), with their ratio; each build's time per p * m.
--address ADDR: instead of `dd.local_cluster(2)`, a running cluster's scheduler (two workers
with the slot0 / slot1 resources, started as the README's "Running on a real cluster" says).
Usage: python benchmarks/bench_fixed_cost.py [--width 64] [--batch 64] [--layers 4]
       [--microbatches 8] [--steps 20] [--rounds 3] [--scale 4:16 16:64 64:256] [--floor]
       [--zero] [--switch KEY] [--address ADDR]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import dask
import jax
import optax

import dagdiff as dd
from dagdiff.lowering import template as templates

try:
    from common import job_args, mean_seconds, mlp_data, time_steps, two_stage_loss
except ImportError:                       # run from the repository root
    from benchmarks.common import (job_args, mean_seconds, mlp_data, time_steps,
                                   two_stage_loss)


#: the dask config key switched on / off between rounds unless --switch names another
TEMPLATES_KEY = "dagdiff.step-templates"


class GcClock:
    """Time the client process spends in the cyclic garbage collector (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2


def make_job(cfg: argparse.Namespace) -> tuple[Any, Any, list[tuple[Any, ...]], str]:
    """(loss_fn, params, batches, what): the MLP job, or with --zero two zero-time stages
    (`sleepy_pipeline(2, 0)`: each stage multiplies by its scalar parameter, so a step is
    its fixed cost plus a few tiny JAX calls per microbatch)."""
    if cfg.zero:
        import jax.numpy as jnp

        from dagdiff.examples.simulated import sleepy_pipeline

        xs = [jax.random.normal(jax.random.PRNGKey(i), (cfg.batch, cfg.width))
              for i in range(4)]
        return (sleepy_pipeline(2, 0.0), [jnp.float32(1.0)] * 2, [(x,) for x in xs],
                f"2 zero-time stages (x * p), batch {cfg.batch} x {cfg.width}")
    params, batches = mlp_data(cfg.width, cfg.batch, cfg.layers, batches=4)
    return (two_stage_loss, params, batches,
            f"{cfg.layers} layers x {cfg.width}, batch {cfg.batch}, 2 stages")


def value_and_grad_parts(client: Any, step: Any, params: Any, batches: list[Any],
                         n: int) -> dict[str, float]:
    parts: dict[str, list[float]] = {"build": [], "submit": [], "wait": [], "step": []}
    for i in range(n):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss, grads = step(params, *batch)
        t1 = time.perf_counter()
        # the leaves, not the pytree: a list would make Dask add a task that gathers every
        # gradient on one worker (README)
        futures = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
        t2 = time.perf_counter()
        client.gather(futures)
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[k].append(v)
    return {k: statistics.median(v) for k, v in parts.items()}


def trainer_steps(client: Any, cfg: argparse.Namespace, loss_fn: Any, params: Any,
                  batches: list[Any], n: int) -> dict[str, float]:
    trainer = dd.Trainer(loss_fn, optax.sgd(1e-3), microbatches=cfg.microbatches,
                         schedule="1f1b", client=client)
    state = trainer.init(params)
    state, loss = trainer.step(state, *batches[0])      # places the state, compiles
    loss.result()

    def one(i: int, batch: Any) -> Any:
        nonlocal state
        state, loss = trainer.step(state, *batch)
        return loss.result()

    times, _ = time_steps(one, [batches[i % len(batches)] for i in range(n)])
    fits = mean_seconds(lambda: trainer.fit([batches[i % len(batches)] for i in range(n)],
                                            state=state, progress=False), n, repeat=2)
    return {"trainer.step": statistics.median(times), "fit": min(fits)}


def _noop(*args: Any) -> int:
    return 0


async def _anoop(*args: Any) -> int:
    return 0


def _get(client: Any, tasks: dict[str, tuple[Any, str, tuple[Any, ...]]],
         keys: list[str]) -> list[Any]:
    """Futures of `keys` of a graph of `tasks` (key -> (function, worker address,
    dependencies: keys of `tasks` or Futures)), each pinned to its worker, submitted as
    dagdiff submits a step (`Client.get` of one layer, not `client.compute`)."""
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    dsk = {k: (f, *deps) for k, (f, _, deps) in tasks.items()}
    where = {k: [w] for k, (_, w, _) in tasks.items()}
    layer = MaterializedLayer(dsk, annotations={"workers": where.get,
                                                "allow_other_workers": False})
    return client.get(HighLevelGraph({"floor": layer}, {"floor": set()}), keys, sync=False)


def floor_steps(client: Any, n: int, outputs: int) -> dict[str, float]:
    """Median seconds of `n` plain Dask steps shaped like dagdiff's (see --floor)."""
    from distributed import wait

    from dagdiff.cluster.info import slot_names

    by_slot = {v: k for k, v in slot_names(client).items()}
    w0, w1 = by_slot["slot0"], by_slot["slot1"]
    tag = time.monotonic_ns()
    one, vg, tr = [], [], []
    picks: list[Any] = []              # the previous step's pick futures
    for i in range(n):
        t0 = time.perf_counter()
        client.submit(_noop, i, tag, pure=False, workers=[w0]).result()
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        progs = (f"prog0-{i}-{tag}", f"prog1-{i}-{tag}")
        tasks = {progs[0]: (_noop, w0, ()), progs[1]: (_noop, w1, ())}
        outs = [f"out{j}-{i}-{tag}" for j in range(outputs + 1)]
        tasks.update({o: (_anoop, (w0, w1)[j % 2], progs) for j, o in enumerate(outs)})
        futures = _get(client, tasks, outs)
        wait(futures)
        vg.append(time.perf_counter() - t0)
        del futures
        t0 = time.perf_counter()
        progs = (f"tprog0-{i}-{tag}", f"tprog1-{i}-{tag}")
        tasks = {progs[j]: (_noop, w, picks[j:j + 1]) for j, w in enumerate((w0, w1))}
        loss = f"tloss-{i}-{tag}"
        tasks[loss] = (_anoop, w1, progs)
        new_picks = tuple(f"pick{j}-{i}-{tag}" for j in range(2))
        tasks.update({k: (_anoop, w, (progs[j],))
                      for j, (k, w) in enumerate(zip(new_picks, (w0, w1)))})
        futures = _get(client, tasks, [loss, *new_picks])
        futures[0].result()
        picks = futures[1:]
        tr.append(time.perf_counter() - t0)
    del picks
    return {"floor 1 task": statistics.median(one),
            "floor value_and_grad": statistics.median(vg),
            "floor trainer.step": statistics.median(tr)}


def floor(client: Any, cfg: argparse.Namespace) -> None:
    loss_fn, params, batches, what = make_job(cfg)
    step = dd.value_and_grad(loss_fn, microbatches=cfg.microbatches, schedule="1f1b")
    value_and_grad_parts(client, step, params, batches, 3)              # compile, warm up
    outputs = len(jax.tree_util.tree_leaves(params))
    floor_steps(client, 3, outputs)
    rows: dict[str, list[float]] = {}
    for r in range(cfg.rounds):
        got = {"value_and_grad": value_and_grad_parts(client, step, params, batches,
                                                      cfg.steps)["step"]}
        got.update(floor_steps(client, cfg.steps, outputs))
        got["trainer.step"] = trainer_steps(client, cfg, loss_fn, params, batches,
                                            cfg.steps)["trainer.step"]
        for k, v in got.items():
            rows.setdefault(k, []).append(v)
        print(f"round {r + 1}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in got.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{what}, 1F1B x {cfg.microbatches}; median of {cfg.steps} steps, median of "
          f"{cfg.rounds} rounds")
    print(f"one no-op task (client.submit(...).result()): {1e3 * med['floor 1 task']:.1f} ms")
    for what in ("value_and_grad", "trainer.step"):
        a, b = med[what], med[f"floor {what}"]
        print(f"{what:16s} dagdiff {1e3 * a:6.1f} ms, its graph's Dask floor {1e3 * b:6.1f} ms "
              f"({b / a:.0%} of the step), dagdiff's own part {1e3 * (a - b):6.1f} ms")


def scale(pairs: list[str]) -> None:
    import jax.numpy as jnp
    from distributed import Client

    from dagdiff.examples.simulated import sleepy_pipeline

    print(f"{'p':>4s} {'m':>5s} {'first build':>12s} {'first run':>10s} {'bound build':>12s} "
          f"{'bound/first':>12s} {'first/(p*m)':>12s}")
    for pair in pairs:
        p, m = map(int, pair.split(":"))
        cluster = dd.local_cluster(n_workers=p, dashboard_address=None, quiet=True,
                                   processes=False)
        client = Client(cluster, set_as_default=False)
        fn = sleepy_pipeline(p, 0.0)
        params = [jnp.float32(1.0)] * p
        step = dd.value_and_grad(fn, microbatches=m, schedule="1f1b")
        templates.clear()
        with client.as_current():
            t0 = time.perf_counter()
            out = step(params, jnp.ones((m, 2)))
            t1 = time.perf_counter()
            client.compute(list(out), sync=True)
            t2 = time.perf_counter()
            bound = []
            for i in range(3):
                t3 = time.perf_counter()
                step(params, jnp.ones((m, 2)) * (i + 2))
                bound.append(time.perf_counter() - t3)
        b = statistics.median(bound)
        print(f"{p:4d} {m:5d} {1e3 * (t1 - t0):10.1f} ms {1e3 * (t2 - t1):8.1f} ms "
              f"{1e3 * b:10.1f} ms {b / (t1 - t0):12.3f} {1e6 * (t1 - t0) / (p * m):9.1f} us",
              flush=True)
        client.close()
        cluster.close()


def _configure(settings: dict[str, Any]) -> None:
    """On a worker: set dask config for the programs that start from now on."""
    dask.config.set(settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    job_args(ap, width=64, batch=64, layers=4, microbatches=8, steps=20, rounds=3)
    ap.add_argument("--scale", nargs="+", default=None, metavar="P:M")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--switch", default=TEMPLATES_KEY, metavar="KEY")
    ap.add_argument("--address", default=None,
                    help="a running cluster's scheduler (two workers with slot0 / slot1, "
                         "started as the README's 'Running on a real cluster' says)")
    cfg = ap.parse_args()
    if cfg.scale:
        scale(cfg.scale)
        return
    from distributed import Client

    if cfg.address:
        cluster, client = None, Client(cfg.address)
    else:
        cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
        client = Client(cluster)
    if cfg.floor:
        floor(client, cfg)
        client.close()
        if cluster is not None:
            cluster.close()
        return
    loss_fn, params, batches, what = make_job(cfg)
    step = dd.value_and_grad(loss_fn, microbatches=cfg.microbatches, schedule="1f1b")
    key = cfg.switch
    with dask.config.set({TEMPLATES_KEY: False}):
        value_and_grad_parts(client, step, params, batches, 3)          # compile, warm up
    on, off = ("templates", "lowering") if key == TEMPLATES_KEY else (f"{key}=on", "off")
    rows: dict[str, dict[str, list[float]]] = {on: {}, off: {}}
    for r in range(cfg.rounds):
        for mode in (on, off):
            client.run(_configure, {key: mode == on})       # workers read it too
            with dask.config.set({key: mode == on}):
                templates.clear()
                clock = GcClock()
                gc.callbacks.append(clock)
                try:
                    got = value_and_grad_parts(client, step, params, batches, cfg.steps)
                    got.update(trainer_steps(client, cfg, loss_fn, params, batches,
                                             cfg.steps))
                finally:
                    gc.callbacks.remove(clock)
                # per step of the 4 * steps the round ran (value_and_grad, step, 2 fits)
                got["client gc"] = clock.seconds / (4 * cfg.steps)
            for k, v in got.items():
                rows[mode].setdefault(k, []).append(v)
        print(f"round {r + 1}: " + ", ".join(
            f"{k} {1e3 * rows[on][k][-1]:.1f} / {1e3 * rows[off][k][-1]:.1f} ms"
            for k in rows[on]), flush=True)
    client.run(_configure, {key: dask.config.get(key, True)})
    print(f"\n{what}, 1F1B x {cfg.microbatches}; median of {cfg.steps} steps, median of "
          f"{cfg.rounds} rounds")
    print(f"{'':16s} {on:>10s} {off:>10s} {'ratio':>7s}")
    for k in rows[on]:
        a = statistics.median(rows[on][k])
        b = statistics.median(rows[off][k])
        print(f"{k:16s} {1e3 * a:8.1f} ms {1e3 * b:8.1f} ms {a / b:7.2f}")
    client.close()
    if cluster is not None:
        cluster.close()


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
