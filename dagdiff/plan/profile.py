"""`dd.profile`: real pipeline steps of a model, recorded and measured into a `Profile`."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import dask
import jax

from ..build import Build, Options, build, trace_model
from ..cluster.info import current_client, workers_info
from ..errors import ArgumentError
from ..inspect.capture import record
from ..inspect.record import Recording
from ..schedules import Interleaved, InterleavedZeroBubble, LoopedBFS, Schedule, get_schedule
from .costs import Profile
from .measure import measure_bandwidth

__all__ = ["profile"]

def _default_schedules(num_stages: int, workers: int, m: int) -> tuple[Schedule, ...]:
    """A full-backward and a split-backward schedule that lay `num_stages` stages out on
    `workers` workers (1F1B + ZB-H1 for one stage per worker; interleaved (or looped
    BFS when m is not a multiple of the workers) + interleaved-zb for several)."""
    if num_stages <= workers:
        return get_schedule("1f1b"), get_schedule("zb-h1")
    if num_stages % workers:
        raise ArgumentError(
            f"dd.profile: {num_stages} stages do not lay out on {workers} workers (no "
            f"built-in schedule puts {num_stages / workers:.2f} stages on each); fix: make "
            f"the stage count a multiple of the workers, or pass schedules=")
    v = num_stages // workers
    full = Interleaved(v) if m % workers == 0 else LoopedBFS(v)
    return full, InterleavedZeroBubble(v)


def profile(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
            *, microbatches: int = 8, schedules: Iterable[Any] | None = None,
            client: Any = None, stages: Any = None, placement: Mapping[int, Any] | None = None,
            batch_argnums: Sequence[int] | None = None, batch_axis: int = 0,
            warmup: int = 1, steps: int = 1, bandwidth: bool = True,
            contention: float | None = None) -> Callable[..., Profile]:
    """Measure `fn` (a loss function, as for `dd.value_and_grad`) on a cluster:
    ``prof = dd.profile(loss_fn, microbatches=8, stages=2)(params, x, t)``.

    Runs, for each of `schedules` (default: a full-backward and a split-backward one
    for the model's layout: "1f1b" and "zb-h1" for one stage per worker), `warmup`
    steps (compiling) and then `steps` recorded steps (`dd.record`), and returns the
    `Profile` of those: per stage the median F, B, I, W seconds, the bytes sent to the
    next and previous stage, the hop latency between workers measured in the step, and
    (`bandwidth=True`, two workers or more) the bandwidth between the first two
    workers. `contention` (None: fitted; 0 for workers that never share a core, e.g. one
    per GPU) says how much workers on one host slow each other (see `simulate`).
    Gradients stay on the workers. Needs a distributed client (given, or the current
    one)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= lo
               for x, lo in ((warmup, 0), (steps, 1))):
        raise ArgumentError(f"dd.profile: warmup must be an int >= 0 and steps an int >= 1, "
                            f"got warmup={warmup!r}, steps={steps!r}")
    chosen = None if schedules is None else tuple(get_schedule(s) for s in schedules)
    if chosen is not None and not chosen:
        raise ArgumentError("dd.profile: schedules is empty; fix: pass schedule names, e.g. "
                            "schedules=('1f1b', 'zb-h1'), or leave it out")

    def options(schedule: Any, fuse: bool | None = None) -> Options:
        return Options.make("dd.profile", argnums=argnums, has_aux=has_aux,
                            microbatches=microbatches, schedule=schedule,
                            batch_argnums=batch_argnums, batch_axis=batch_axis, stages=stages,
                            placement=placement, fuse=fuse)

    options("1f1b" if chosen is None else chosen[0])      # bad options fail here, at once

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Profile:
        c = client if client is not None else current_client()
        if c is None or not hasattr(c, "scheduler_info"):
            raise ArgumentError(
                "dd.profile needs a distributed client (client=, or `with "
                "client.as_current():`), got none; fix: client = distributed.Client("
                "dd.local_cluster(2)) and pass it")
        # the staged trace before fusion: the layer calls `stages=profile` balances
        raw = trace_model(fn, args, kwargs, options("1f1b", fuse=False), c).trace
        nstages = len({n.stage for n in raw.nodes if n.kind == "call" and n.stage is not None})
        scheds = chosen if chosen is not None else _default_schedules(
            nstages, len(workers_info(c)), microbatches)
        runs: list[tuple[Recording, Build]] = []
        walls: list[float] = []
        for sched in scheds:
            # forwards and backwards timed apart: with the loss's backward fused into its
            # forward (`lower`'s fuse_seeded, under 1F1B) the last stage's B would read ~0
            # and F would hold both, which predictions for other schedules cannot split
            with dask.config.set({"dagdiff.fuse-loss-backward": False}):
                b = build(fn, args, kwargs, options(sched), c)
            loss, grads = b.outputs()
            for k in range(warmup + steps):
                if k < warmup:
                    _step(c, loss, grads)
                    continue
                with record(c) as rec:
                    t0 = time.perf_counter()
                    _step(c, loss, grads)
                    walls.append(time.perf_counter() - t0)
                runs.append((rec, b))
        bw = None
        first = runs[0][1]
        addrs = [first.targets.addresses.get(first.targets.of[s], first.targets.of[s])
                 for s in sorted(first.targets.of)]
        addrs = list(dict.fromkeys(str(a) for a in addrs))
        if bandwidth and len(addrs) >= 2 and all("://" in a for a in addrs[:2]):
            bw = measure_bandwidth(c, addrs[0], addrs[1])
        return Profile.from_recording(runs[0][0], first, also=runs[1:], raw_trace=raw,
                                      bandwidth=bw, walls=walls, contention=contention)

    return run


def _step(client: Any, loss: Any, grads: Any) -> None:
    """Compute one step and wait for it; the gradients stay on the workers."""
    from distributed import wait

    futures = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
    with client.as_current():
        wait(futures)
    errors = [f.exception() for f in futures if f.status == "error"]
    if errors:
        raise errors[0]
    del futures

