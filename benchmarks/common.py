"""Layers shared by the benchmarks (run them as scripts: `python benchmarks/bench_x.py`)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

import dagdiff as dd

__all__ = ["dense", "mse"]


@dd.layer
def dense(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


@dd.layer
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)
