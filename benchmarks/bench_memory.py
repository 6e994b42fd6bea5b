"""Memory as a planned resource, side by side in one run on a 2-worker local cluster.

A two-stage MLP under 1F1B whose activations dominate its parameters. The limit is set
below what 1F1B without recomputation measurably holds on its first worker; the planner
(`dd.best_schedule(profile, memory_limit=...)`) picks a policy per stage, and the plan
is run and measured next to no recomputation and full recomputation everywhere (the
policy a user would otherwise pick). Prints, per run: the measured peak per worker
(`dd.record(...).peak_memory()`), the predicted one, the median step time, and whether
the gradients equal `jax.value_and_grad`'s. "predicted" is what samples between tasks
see (CPU: no allocator peak), "incl. calls" adds what exists only inside one call (the
loss stage's fused forward and backward). Then the estimate against the measurement for
every built-in schedule and policy, on the MLP and on the transformer of notebooks/04
(`--all-schedules`).

    python benchmarks/bench_memory.py [--width 256 --batch 4096 --layers 8 --steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from distributed import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dagdiff as dd  # noqa: E402
from common import mlp_data, two_stage_loss  # noqa: E402

MiB = 2**20


def run(client: Any, loss: Any, args: tuple[Any, ...], schedule: Any, m: int, remat: Any,
        steps: int) -> tuple[dict[str, int], float, Any]:
    """Measured peak per slot, median step seconds and the last (loss, grads)."""
    step = dd.value_and_grad(loss, microbatches=m, schedule=schedule, remat=remat)
    out = step.compute(*args, client=client)                 # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step.compute(*args, client=client)
        times.append(time.perf_counter() - t0)
    with dd.record(client) as rec:
        out = step.compute(*args, client=client)
    peaks = {rec.worker_names.get(w, w): n for w, n in rec.peak_memory().items()}
    return peaks, statistics.median(times) if times else 0.0, out


def equal_to_jax(loss: Any, args: tuple[Any, ...], out: Any) -> bool:
    want_l, want_g = jax.value_and_grad(loss)(*args)
    got_l, got_g = out
    ok = np.allclose(got_l, want_l, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g)):
        ok = ok and np.allclose(a, b, rtol=1e-4, atol=1e-6)
    return bool(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all-schedules", action="store_true")
    a = ap.parse_args()
    params, data = mlp_data(a.width, a.batch, a.layers, batches=1)
    args = (params, *data[0])
    loss = two_stage_loss
    m = a.microbatches
    cluster = dd.local_cluster(2, quiet=True, dashboard_address=None)
    client = Client(cluster)
    try:
        prof = dd.profile(loss, microbatches=m, schedules=["1f1b"], client=client)(*args)
        plain, t_plain, out_plain = run(client, loss, args, "1f1b", m, "none", a.steps)
        limit = int(0.92 * plain["slot0"])
        print(f"job: {a.layers} tanh layers {a.width} wide, batch {a.batch}, 2 stages, "
              f"1F1B x{m}; limit {limit / MiB:.2f} MiB per worker (92% of the first "
              "worker's measured peak without recomputation)\n")
        _, _, plan = dd.best_schedule(prof, memory_limit=limit, schedules=["1f1b"])[0]
        rows = []
        for label, remat in (("none", "none"), ("plan " + str(plan.remat), plan.remat),
                             ("full everywhere", "full")):
            if remat == "none":
                peaks, t, out = plain, t_plain, out_plain
            else:
                peaks, t, out = run(client, loss, args, "1f1b", m, remat, a.steps)
            pred = dd.predict("1f1b", prof, m, remat=remat)
            fits = all(v <= limit for v in peaks.values())
            rows.append((label, peaks, pred, t, fits, equal_to_jax(loss, args, out)))
        print(f"{'remat':34s} {'measured MiB (w0, w1)':>22s} {'predicted':>13s} "
              f"{'incl. calls':>13s} {'step ms':>8s} {'fits':>5s} {'grads = jax':>11s}")
        for label, peaks, pred, t, fits, ok in rows:
            meas = f"{peaks['slot0'] / MiB:.2f}, {peaks['slot1'] / MiB:.2f}"
            between, inside = pred.memory_between_tasks, pred.memory
            pr = f"{between[0] / MiB:.2f}, {between[1] / MiB:.2f}"
            pc = f"{inside[0] / MiB:.2f}, {inside[1] / MiB:.2f}"
            print(f"{label:34s} {meas:>22s} {pr:>13s} {pc:>13s} {t * 1e3:8.1f} "
                  f"{str(fits):>5s} {str(ok):>11s}")
        t_plan, t_full = rows[1][3], rows[2][3]
        print(f"\nplan / full recomputation step time: {t_plan / t_full:.2f}x")
        if a.all_schedules:
            estimates(client, params, data[0], m)
    finally:
        client.close()
        cluster.close()


def transformer(n_stages: int, blocks: int = 4, vocab: int = 64, T: int = 64, D: int = 128,
                heads: int = 4, batch: int = 64) -> tuple[Any, tuple[Any, ...]]:
    """The character LM of notebooks/04 (pre-norm attention blocks, causal mask, GELU MLP),
    wider: `blocks` blocks spread over `n_stages` stages (embedding on the first, the
    loss on the last); (loss, (params, tokens, targets))."""
    def norm(x: Any, g: Any, b: Any) -> Any:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    @dd.layer
    def embed(p: Any, tokens: Any) -> Any:
        return p["tok"][tokens] + p["pos"][: tokens.shape[1]]

    @dd.layer
    def block(p: Any, x: Any) -> Any:
        b, t, d = x.shape
        h = norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = (jnp.einsum("btd,de->bte", h, p[n]).reshape(b, t, heads, d // heads)
                   for n in ("wq", "wk", "wv"))
        att = jnp.einsum("bthe,bshe->bhts", q, k) / jnp.sqrt(d // heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        h = jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(att, -1), v).reshape(b, t, d)
        x = x + h @ p["wo"]
        h = norm(x, p["ln2_g"], p["ln2_b"])
        return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    @dd.layer
    def lm_loss(p: Any, x: Any, targets: Any) -> Any:
        logits = norm(x, p["g"], p["b"]) @ p["head"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None],
                                    -1).mean()

    def loss(params: Any, tokens: Any, targets: Any) -> Any:
        with dd.stage(0):
            x = embed(params["embed"], tokens)
        for i, bp in enumerate(params["blocks"]):
            with dd.stage(i * n_stages // blocks):
                x = block(bp, x)
        with dd.stage(n_stages - 1):
            return lm_loss(params["head"], x, targets)

    ks = iter(jax.random.split(jax.random.PRNGKey(0), 64))

    def n(*shape: int) -> Any:
        return jax.random.normal(next(ks), shape) * 0.02

    def blk() -> dict[str, Any]:
        return {"ln1_g": jnp.ones(D), "ln1_b": jnp.zeros(D), "wq": n(D, D), "wk": n(D, D),
                "wv": n(D, D), "wo": n(D, D), "ln2_g": jnp.ones(D), "ln2_b": jnp.zeros(D),
                "w1": n(D, 4 * D), "w2": n(4 * D, D)}

    params = {"embed": {"tok": n(vocab, D), "pos": n(T, D)},
              "blocks": [blk() for _ in range(blocks)],
              "head": {"g": jnp.ones(D), "b": jnp.zeros(D), "head": n(D, vocab)}}
    tokens = jax.random.randint(next(ks), (batch, T), 0, vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    return loss, (params, tokens, targets)


def estimates(client: Any, params: Any, batch: Any, m: int) -> None:
    """Predicted (the trace's footprint over the schedule's order) against measured peaks,
    every built-in schedule and policy, 2 workers (two stages each for the multi-chunk
    ones), on the MLP job and on the transformer of notebooks/04."""
    from dagdiff.build import Options, trace_model
    from dagdiff.core.footprint import stage_footprints
    from dagdiff.lowering.memory import loss_fused, step_memory
    from dagdiff.schedules import SCHEDULES

    from common import dense, mse

    def mlp(n: int) -> tuple[Any, tuple[Any, ...]]:
        def loss(ps: Any, x: Any, t: Any) -> Any:
            h = x
            for i, p in enumerate(ps):
                with dd.stage(i * n // len(ps)):
                    h = dense(p, h)
            with dd.stage(n - 1):
                return mse(h, t)
        return loss, (params, *batch)

    errors = []
    first: dict[str, tuple[Any, ...]] = {}
    for label, make in (("mlp", mlp), ("transformer", transformer)):
        client.restart()        # each model on fresh workers: nothing left of the last one
        print(f"\n{label}: {'schedule':14s} {'remat':10s} {'w0 measured / predicted MiB':>30s} "
              f"{'w1 measured / predicted MiB':>30s}")
        for name in SCHEDULES:
            multi = name in ("interleaved", "looped-bfs", "interleaved-zb")
            sched = dd.get_schedule(name, virtual_stages=2) if multi else dd.get_schedule(name)
            loss, args = make(2 * sched.virtual_stages)
            # one set of arrays per model for every schedule (the transformer's are the
            # same values at any stage count): a new set would be scattered again while
            # the last one's copies can still be held (the client keeps the arrays of
            # a step it ran alive), and the worker would count two sets of parameters
            args = first.setdefault(label, args)
            for remat in ("none", "selective", "full"):
                peaks, _, _ = run(client, loss, args, sched, m, remat, 0)
                model = trace_model(loss, args, {}, Options.make(
                    "bench", microbatches=m, schedule=sched, remat=remat), None)
                fps = stage_footprints(model.trace)
                pred = step_memory(fps, sched, 2, m, remat, loss_fused(
                    model.trace, sched, m, model.trace.nodes[model.loss.node].stage),
                    inside_calls=False)
                cells = []
                for w in range(2):
                    got, want = peaks[f"slot{w}"], pred[w].bytes
                    errors.append(abs(want - got) / got)
                    cells.append(f"{got / MiB:.2f} / {want / MiB:.2f} ({(want - got) / got:+.0%})")
                print(f"{'':{len(label) + 2}s}{name:14s} {remat:10s} {cells[0]:>30s} "
                      f"{cells[1]:>30s}", flush=True)
    errors.sort()
    print(f"\nprediction error over {len(errors)} (schedule, policy, worker): median "
          f"{errors[len(errors) // 2]:.1%}, within 10%: "
          f"{sum(e <= 0.10 for e in errors)}/{len(errors)}, worst {errors[-1]:.1%}")


if __name__ == "__main__":
    jnp.zeros(1).block_until_ready()
    main()
