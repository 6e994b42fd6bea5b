"""Sleep-based stand-in stages for measuring schedules: forward, input-gradient and
weight-gradient each sleep a fixed time (sleeping frees the CPU, so many workers fit on
a small machine). Used by the pipeline benchmark, the inspection tests and notebooks."""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..core import stage as placement
from ..core.layer import Layer, layer


__all__ = ["sleepy_stage", "sleepy_pipeline", "callback_cost"]


def _sleep_then(dt: float, x: np.ndarray) -> np.ndarray:
    time.sleep(dt)
    return np.asarray(x)


_COST: dict[float, float] = {}
_COST_LOCK = threading.Lock()


def callback_cost(dt: float = 0.005) -> float:
    """Seconds a jitted host callback that sleeps `dt` costs around its sleep in this
    process (about 1 ms on a small CPU machine), measured once per `dt`: the stand-in
    sleeps that much less, so a task takes its nominal time as the schedule formulas
    assume (the pipeline benchmark prints the measured times next to the nominal ones).
    Sleeps over 20 ms are calibrated at 20 ms (the cost stops growing by then)."""
    dt = min(round(float(dt), 4), 0.02)
    with _COST_LOCK:
        if dt not in _COST:
            # measured on its own thread: JAX's tracing state is per thread, and this
            # is called while a stage is being traced
            t = threading.Thread(target=lambda: _COST.setdefault(dt, _measure_cost(dt)),
                                 name="dagdiff-sleepy-calibration")
            t.start()
            t.join()
        return _COST.get(dt, 0.0)


def _measure_cost(dt: float, n: int = 5) -> float:
    f = jax.jit(lambda x: jax.pure_callback(functools.partial(_sleep_then, dt),
                                            jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    x = jnp.zeros(1)
    jax.block_until_ready(f(x))
    extra = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        extra.append(time.perf_counter() - t0 - dt)
    return float(min(max(np.median(extra), 0.0), 0.005, dt / 2))


def _slow(dt: float, x: Any) -> Any:
    if dt <= 0:
        return x
    dt = max(dt - callback_cost(dt), 0.0)
    return jax.pure_callback(functools.partial(_sleep_then, dt),
                             jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def sleepy_stage(f: float, i: float, w: float, name: str = "sleepy") -> Layer:
    """A layer ``y = w * x`` whose forward sleeps `f` s, input-gradient `i` s and
    weight-gradient `w` s (a B task, needing both, sleeps i + w)."""

    def apply(p: Any, x: Any) -> Any:
        return _sleepy_op(f, i, w)(p, x)

    return layer(apply, name=name)


def _sleepy_op(f: float, i: float, w: float) -> Any:
    @jax.custom_vjp
    def op(p: Any, x: Any) -> Any:
        return _slow(f, x) * p

    def fwd(p: Any, x: Any) -> Any:
        return _slow(f, x) * p, (p, x)

    def bwd(res: Any, ct: Any) -> Any:
        p, x = res
        dx = _slow(i, ct * p)
        dp = jnp.sum(_slow(w, ct * x))
        return dp, dx

    op.defvjp(fwd, bwd)
    return op


@layer(name="loss")
def _mean_sq(y: Any) -> Any:
    return jnp.mean(y * y)


@layer(name="scale_in")
def _scale_in(s: Any, x: Any) -> Any:
    """Makes stage 0's input depend on a parameter, so stage 0 has an input gradient to
    compute (and sleep for) like every other stage."""
    return x * s


def sleepy_pipeline(p: int, f: float, i: float | None = None, w: float | None = None,
                    chunks: int = 1) -> Callable[..., Any]:
    """A loss function of `p * chunks` sleepy stages (stage k in ``dd.stage(k)``): for
    interleaved schedules use chunks = virtual stages; each chunk sleeps f/chunks etc."""
    i = f if i is None else i
    w = f if w is None else w
    n = p * chunks
    stages = [sleepy_stage(f / chunks, i / chunks, w / chunks, name=f"stage{k}")
              for k in range(n)]

    def loss_fn(params: Any, x: Any) -> Any:
        with placement.stage(0):
            h = _scale_in(params[0], x)
        for k in range(n):
            with placement.stage(k):
                h = stages[k](params[k], h)
        with placement.stage(n - 1):
            return _mean_sq(h)

    return loss_fn
