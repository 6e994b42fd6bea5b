"""The job arguments and timing loops the benchmarks share; no JAX or dagdiff import, so a
script's parent process stays as light as its peers' (torch ranks are other processes)."""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Iterable

__all__ = ["job_args", "time_steps", "mean_seconds"]

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
               value: Callable[[Any], float] = float,
               before: Callable[[], Any] | None = None) -> tuple[list[float], float]:
    """Run ``run(i, batch)`` for each batch and time each call (wall clock); returns the
    seconds of the calls after the first `warmup` ones, and ``value`` of the first call's
    result (e.g. the first loss, which every system computes from the same data).
    `before()` runs ahead of each call, untimed (e.g. releasing the previous step's
    futures)."""
    times: list[float] = []
    first = float("nan")
    for i, batch in enumerate(batches):
        if before is not None:
            before()
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
