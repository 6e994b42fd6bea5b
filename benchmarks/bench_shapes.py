"""The cost of a new shape: batches whose sequence length changes per step, with and
without `dd.pad_to_bucket`, against one-process `jax.jit` on the same lengths.

The job: a 2-stage model over (batch, length, width) sequences (--layers tanh layers
per stage, masked mean-square loss), 1F1B x --microbatches on `dd.local_cluster(2)`, a
`dd.value_and_grad(...).compute` step per batch. One run measures, in turn:
  seen      a step at a length seen before (median of --repeat);
  new       the first step at each of --new lengths never seen: its time minus `seen` is
            what a new shape costs (tracing, lowering, one compile per layer signature
            on each worker);
  stream    --steps batches of random lengths in [--min, --max]: exact lengths against
            the same batches padded to --buckets, each on restarted workers (nothing
            compiled but length 64): total time, layer signatures compiled on the workers
            (`dd.compile_counts`), and a fresh `jax.jit(jax.value_and_grad)` on both.
Usage: python benchmarks/bench_shapes.py [--width 256] [--batch 16] [--layers 2]
       [--microbatches 4] [--steps 40] [--min 16] [--max 128] [--buckets 32 64 96 128]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dagdiff as dd


def make_model(width: int, layers: int) -> tuple[Any, Any, Any]:
    @dd.layer(name="stage0", stage=0)
    def stage0(ps: Any, x: Any) -> Any:
        for p in ps:
            x = jnp.tanh(x @ p)
        return x

    @dd.layer(name="stage1", stage=1)
    def stage1(ps: Any, x: Any, t: Any, mask: Any) -> Any:
        for p in ps:
            x = jnp.tanh(x @ p)
        m = mask.astype(x.dtype)[..., None]
        per_row = jnp.sum(((x - t) * m) ** 2, axis=(1, 2)) / (jnp.sum(m, axis=(1, 2)) + 1)
        return jnp.mean(per_row)

    def loss(params: Any, x: Any, t: Any, mask: Any) -> Any:
        return stage1(params[1], stage0(params[0], x), t, mask)

    keys = jax.random.split(jax.random.key(0), 2 * layers)
    params = [[jax.random.normal(k, (width, width)) / np.sqrt(width)
               for k in keys[s * layers:(s + 1) * layers]] for s in range(2)]
    return loss, params, jax.jit(jax.value_and_grad(loss))


def batch(rng: np.random.Generator, n: int, length: int, width: int) -> tuple[Any, ...]:
    x = jnp.asarray(rng.standard_normal((n, length, width), dtype=np.float32))
    t = jnp.asarray(rng.standard_normal((n, length, width), dtype=np.float32))
    lengths = rng.integers(1, length + 1, size=n)
    mask = jnp.asarray(np.arange(length)[None, :] < lengths[:, None])
    return x, t, mask


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--new", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--min", type=int, default=16)
    ap.add_argument("--max", type=int, default=128)
    ap.add_argument("--buckets", type=int, nargs="+", default=[32, 64, 96, 128])
    a = ap.parse_args()
    from distributed import Client

    loss, params, _ = make_model(a.width, a.layers)
    rng = np.random.default_rng(0)
    cluster = dd.local_cluster(n_workers=2, quiet=True, dashboard_address=None)
    client = Client(cluster)
    step = dd.value_and_grad(loss, microbatches=a.microbatches, schedule="1f1b")

    def run(b: tuple[Any, ...]) -> Any:
        return step.compute(params, *b, client=client)

    def compiles() -> int:
        return sum(v for k, v in dd.compile_counts(client).items() if k != "local")

    print(f"job: 2 stages x {a.layers} tanh layers {a.width} wide, batch {a.batch}, "
          f"1F1B x {a.microbatches}, dd.local_cluster(2)")
    seen_batch = batch(rng, a.batch, 64, a.width)
    for _ in range(2):
        run(seen_batch)                                # warm: compiled, templates made
    seen = statistics.median(timed(lambda: run(seen_batch)) for _ in range(a.repeat))
    news = []
    for length in range(65, 65 + a.new):
        b = batch(rng, a.batch, length, a.width)
        news.append(timed(lambda: run(b)))
    new = statistics.median(news)
    print(f"step at a seen length: {seen * 1e3:8.1f} ms   first step at a new length: "
          f"{new * 1e3:8.1f} ms (median of {a.new}) -> a new shape costs "
          f"{(new - seen) * 1e3:.1f} ms ({new / seen:.1f}x a step)")

    lengths = rng.integers(a.min, a.max + 1, size=a.steps)
    stream = [batch(rng, a.batch, int(n), a.width) for n in lengths]
    padded = []
    for x, t, mask in stream:
        (xp, tp, mp), _ = dd.pad_to_bucket((x, t, mask), a.buckets, axis=1, value=0)
        padded.append((xp, tp, mp))
    rows = []
    for label, data in (("exact lengths", stream), ("bucketed", padded)):
        client.restart()                      # fresh workers: no signature compiled yet
        run(seen_batch)                       # their start-up, outside the timing
        c0 = compiles()
        total = sum(timed(lambda b=b: run(b)) for b in data)
        signatures = compiles() - c0
        jitted = jax.jit(jax.value_and_grad(loss))        # a fresh jit cache as well
        jitted(params, *seen_batch)
        jit_total = sum(timed(lambda b=b: jitted(params, *b)) for b in data)
        shapes = len({b[0].shape for b in data})
        rows.append((label, total, signatures, jit_total, shapes))
    print(f"{'stream of ' + str(a.steps) + ' batches':<24} {'shapes':>7} {'dagdiff':>10} "
          f"{'signatures':>11} {'jax.jit':>10} {'ratio':>7}")
    for label, total, sigs, jit_total, shapes in rows:
        print(f"{label:<24} {shapes:>7} {total:>9.2f}s {sigs:>11} {jit_total:>9.2f}s "
              f"{total / jit_total:>6.2f}x")
    (_, exact, _, jexact, _), (_, bucketed, _, jbucket, _) = rows
    print(f"bucketing: dagdiff {exact / bucketed:.2f}x faster over the stream, "
          f"jax.jit {jexact / jbucket:.2f}x")
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
