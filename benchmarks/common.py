"""Layers shared by the benchmarks (run them as scripts: `python benchmarks/bench_x.py`)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

import dagdiff as dd

__all__ = ["dense", "mse", "two_stage_loss"]


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
