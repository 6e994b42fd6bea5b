"""dask.sizeof entry point for JAX arrays (top-level so that dask need not import dagdiff)."""
from __future__ import annotations

from typing import Any

__all__ = ["sizeof_plugin"]


def sizeof_plugin(sizeof: Any) -> None:
    """Register `nbytes` as the size of a jax array, lazily on first use of a jaxlib type."""

    @sizeof.register_lazy("jaxlib")
    def _register() -> None:
        import jax.numpy as jnp

        sizeof.register(type(jnp.zeros(())))(lambda x: int(x.nbytes))
