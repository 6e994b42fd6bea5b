"""Layers and data the benchmarks share (run them as scripts: `python benchmarks/bench_x.py`);
the shared job arguments and timing loops are in `timing` (re-exported here)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import dagdiff as dd

try:
    from timing import job_args, mean_seconds, time_steps
except ImportError:                       # imported as benchmarks.common
    from benchmarks.timing import job_args, mean_seconds, time_steps

__all__ = ["dense", "mse", "two_stage_loss", "tied_stage_loss", "unused_leaf_loss",
           "mlp_data", "job_args", "time_steps", "mean_seconds"]

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


def tied_stage_loss(params: Any, x: Any, t: Any) -> Any:
    """`two_stage_loss` whose first layer's weights are applied once more on stage 1, after
    its first layer (weights tied across stages, as an embedding and its output projection)."""
    h = x
    for i, p in enumerate(params):
        with dd.stage(i * 2 // len(params)):
            h = dense(p, h)
            if i == len(params) // 2:
                h = dense(params[0], h)
    with dd.stage(1):
        return mse(h, t)


def unused_leaf_loss(params: Any, x: Any, t: Any) -> Any:
    """`two_stage_loss` of all but the last layer of `params` (a leaf the loss never
    reads, as a head left out of this loss)."""
    return two_stage_loss(params[:-1], x, t)


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
