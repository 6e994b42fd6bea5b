"""Two checkouts of dagdiff on the same single steps, in alternating processes.

For a change that cannot be switched off in one process (a graph's shape, a scheduler
plugin), run each checkout in its own process, in turns (A, B, A, B, ...), on the tiny job
(`--width 64 --batch 64 --layers 4`, 2 stages, 1F1B x `--microbatches` 8, on
`dd.local_cluster(2)`): per process, two reps of `--steps` steps (after 10) of
  value_and_grad  `client.compute` of the loss and every gradient leaf; the loss read, the
                  gradients waited for (kept on the workers);
  trainer.step    `state, loss = trainer.step(state, x, t); loss.result()` (sgd);
  step.compute    the values on the client;
  fit             `trainer.fit` (adam, its default windows) over 4 x `--steps` batches: per
                  step.
Prints each process's medians, then per kind the median over processes and new / old.
`--model tied`: the first layer's weights applied again on stage 1 (`tied_stage_loss`);
`--model unused`: one more layer the loss never reads (`unused_leaf_loss`).
A checkout is a directory holding the `dagdiff` package (e.g. ``git worktree add /tmp/old
<rev>``), put first on each process's path; the job comes from this script's `common.py`.

Usage: python benchmarks/ab_checkouts.py --old /tmp/old --new . [--rounds 3] [--steps 40]
       [--model mlp|tied|unused]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

KINDS = ("value_and_grad", "trainer.step", "step.compute", "fit")


def child(steps: int, microbatches: int, model: str = "mlp") -> dict[str, list[float]]:
    """In a checkout's process: each kind's median step (ms), two reps each."""
    import jax
    import optax
    from distributed import Client, wait

    import dagdiff as dd
    from common import mlp_data, tied_stage_loss, two_stage_loss, unused_leaf_loss

    cluster = dd.local_cluster(2, quiet=True, dashboard_address=None)
    client = Client(cluster)
    loss_fn = {"mlp": two_stage_loss, "tied": tied_stage_loss,
               "unused": unused_leaf_loss}[model]
    params, data = mlp_data(64, 64, 5 if model == "unused" else 4)
    step = dd.value_and_grad(loss_fn, microbatches=microbatches, schedule="1f1b")
    trainer = dd.Trainer(loss_fn, optax.sgd(0.01), microbatches=microbatches,
                         schedule="1f1b", client=client)
    state = trainer.init(params)
    out: dict[str, list[float]] = {k: [] for k in KINDS}

    def timed(one: Any) -> float:
        times = []
        for i in range(steps + 10):
            t0 = time.perf_counter()
            one(*data[i % len(data)])
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[10:])

    def vg(x: Any, t: Any) -> None:
        loss, grads = step(params, x, t)
        futures = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
        futures[0].result()
        wait(futures)

    def tr(x: Any, t: Any) -> None:
        nonlocal state
        state, loss = trainer.step(state, x, t)
        loss.result()

    fitter = dd.Trainer(loss_fn, optax.adam(1e-3), microbatches=microbatches,
                        schedule="1f1b", client=client)
    fit_state, _ = fitter.fit([data[i % len(data)] for i in range(32)], params=params,
                              progress=False)

    def fit_per_step() -> float:
        nonlocal fit_state
        n = 4 * steps
        t0 = time.perf_counter()
        fit_state, _ = fitter.fit([data[i % len(data)] for i in range(n)], state=fit_state,
                                  progress=False)
        return 1e3 * (time.perf_counter() - t0) / n

    with client.as_current():
        for _ in range(2):
            out["value_and_grad"].append(timed(vg))
            out["trainer.step"].append(timed(tr))
            out["step.compute"].append(timed(
                lambda x, t: step.compute(params, x, t, client=client)))
            out["fit"].append(fit_per_step())
    client.close()
    cluster.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--model", choices=("mlp", "tied", "unused"), default="mlp")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.steps, a.microbatches, a.model)))
        return
    got: dict[str, dict[str, list[float]]] = {"old": {k: [] for k in KINDS},
                                              "new": {k: [] for k in KINDS}}
    for r in range(a.rounds):
        for side in ("old", "new"):
            root = os.path.abspath(getattr(a, side))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [root, os.path.join(root, "benchmarks")])}
            run = subprocess.run(
                [sys.executable, os.path.abspath(__file__),
                 "--old", a.old, "--new", a.new, "--steps", str(a.steps),
                 "--microbatches", str(a.microbatches), "--model", a.model, "--child"],
                env=env, capture_output=True, text=True, timeout=900)
            line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{side} ({root}) failed:\n{run.stderr[-3000:]}")
            res = json.loads(line[len("RESULT "):])
            for k in KINDS:
                got[side][k].extend(res[k])
            print(f"round {r + 1} {side}: " + ", ".join(
                f"{k} {' / '.join(f'{v:.1f}' for v in res[k])} ms" for k in KINDS))
    print(f"\ntiny job ({a.model}), 1F1B x {a.microbatches}; medians over {a.rounds} "
          "processes x 2 reps")
    for k in KINDS:
        old, new = statistics.median(got["old"][k]), statistics.median(got["new"][k])
        print(f"  {k:15s} old {old:6.1f} ms  new {new:6.1f} ms  new / old {new / old:.2f}")


if __name__ == "__main__":
    main()
