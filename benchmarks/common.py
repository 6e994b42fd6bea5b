"""What the benchmarks share: the job's layers and data, its command-line arguments and
the timing loop (run them as scripts: `python benchmarks/bench_x.py`)."""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

import dagdiff as dd

__all__ = ["dense", "mse", "two_stage_loss", "mlp_data", "job_args", "time_steps",
           "mean_seconds"]

#: the help of each job argument `job_args` adds
_JOB_HELP = {
    "width": "units per dense layer",
    "batch": "rows per batch",
    "layers": "dense layers (two stages of layers/2)",
    "microbatches": "microbatches per step",
    "steps": "measured steps",
    "warmup": "steps run before measuring",
    "rounds": "rounds (every system once per round, in turns)",
    "repeat": "repetitions (best or median of them)",
    "seed": "seed of the data",
}


def job_args(ap: argparse.ArgumentParser, **defaults: int) -> argparse.ArgumentParser:
    """Add the job arguments the benchmarks share (``--width``, ``--batch``, ``--layers``,
    ``--microbatches``, ``--steps``, ``--warmup``, ``--rounds``, ``--repeat``, ``--seed``),
    each that `defaults` names, with that default."""
    for name, value in defaults.items():
        if name not in _JOB_HELP:
            raise ValueError(f"job_args: no job argument {name!r} (known: {sorted(_JOB_HELP)})")
        ap.add_argument(f"--{name}", type=int, default=value,
                        help=f"{_JOB_HELP[name]} (default {value})")
    return ap


def time_steps(run: Callable[[int, Any], Any], batches: Iterable[Any], warmup: int = 0,
               value: Callable[[Any], float] = float) -> tuple[list[float], float]:
    """Run ``run(i, batch)`` for each batch and time each call (wall clock); returns the
    seconds of the calls after the first `warmup` ones, and ``value`` of the first call's
    result (e.g. the first loss, which every system computes from the same data)."""
    times: list[float] = []
    first = float("nan")
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out = run(i, batch)
        dt = time.perf_counter() - t0
        if i == 0:
            first = value(out)
        if i >= warmup:
            times.append(dt)
    return times, first


def mean_seconds(run: Callable[[], Any], count: int, repeat: int = 1) -> list[float]:
    """Seconds per item of `repeat` timed calls of `run()`, each doing `count` items
    (e.g. a whole `fit` of `count` steps)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        out.append((time.perf_counter() - t0) / count)
    return out



@dd.layer
def dense(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


@dd.layer
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


def two_stage_loss(params: Any, x: Any, t: Any) -> Any:
    """An MLP of `dense` layers, the first half on stage 0 and the rest on stage 1, MSE."""
    h = x
    for i, p in enumerate(params):
        with dd.stage(i * 2 // len(params)):
            h = dense(p, h)
    with dd.stage(1):
        return mse(h, t)


def mlp_data(width: int, batch: int, layers: int = 4, batches: int = 4) -> tuple[Any, Any]:
    """(params, batches): `layers` dense layers `width` wide (w scaled by 1/sqrt(width)) and
    `batches` (x, t) pairs of `batch` rows, from fixed keys."""
    key = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (width, width))
               / width**0.5, "b": jnp.zeros(width)} for i in range(layers)]
    data = [(jax.random.normal(jax.random.fold_in(key, 10 + i), (batch, width)),
             jax.random.normal(jax.random.fold_in(key, 99 + i), (batch, width)))
            for i in range(batches)]
    return params, data
