"""Microbatch shapes: the arguments' batch leaves as one microbatch's ShapeDtypeStruct."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from ..errors import MicrobatchError


__all__ = ["microbatch_avals"]


def microbatch_avals(args: Sequence[Any], names: Sequence[str], batch_argnums: Sequence[int],
                     axis: int, m: int) -> list[Any]:
    """The arguments with each batch leaf replaced by its microbatch's ShapeDtypeStruct."""
    out = list(args)
    for i in batch_argnums:
        def shrink(x: Any, i: int = i) -> Any:
            if not isinstance(x, (jax.Array, np.ndarray)):
                return x
            shape = tuple(np.shape(x))
            if _one_key(x):
                keep = [j for j in batch_argnums if j != i]
                raise MicrobatchError(
                    f"argument {names[i]!r} is a PRNG key ({x.dtype}{list(shape)}), which "
                    f"cannot be split into {m} microbatches: leave it out of the batch "
                    f"arguments, e.g. batch_argnums={tuple(keep)!r}, and every microbatch "
                    "reads the whole key")
            if not shape:
                raise MicrobatchError(f"argument {names[i]!r} has a scalar leaf; it cannot be "
                                      f"split into {m} microbatches (exclude it with "
                                      "batch_argnums=...)")
            if not -len(shape) <= axis < len(shape):
                raise MicrobatchError(
                    f"batch_axis={axis} but argument {names[i]!r} has shape {shape} "
                    f"({len(shape)} axes); give an axis in {-len(shape)}..{len(shape) - 1}, or "
                    "leave the argument out of batch_argnums")
            ax = axis % len(shape)
            if shape[ax] % m:
                raise MicrobatchError(
                    f"argument {names[i]!r} has shape {shape}: its axis {ax} (size "
                    f"{shape[ax]}) does not divide into {m} microbatches; use a batch size "
                    f"that is a multiple of {m}, or another microbatches=")
            new = list(shape)
            new[ax] //= m
            return jax.ShapeDtypeStruct(tuple(new), x.dtype)
        out[i] = jax.tree_util.tree_map(shrink, args[i])
    return out


def _one_key(x: Any) -> bool:
    """Whether `x` is one PRNG key: a typed key array of no dimension (`jax.random.key`)
    or a raw uint32[2] (`jax.random.PRNGKey`); a batch of keys splits like any batch."""
    dtype = getattr(x, "dtype", None)
    try:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return np.ndim(x) == 0
    except TypeError:
        return False
    return dtype == np.uint32 and tuple(np.shape(x)) == (2,)
