"""`dd.pad_to_bucket`: pad batches whose length changes to a few lengths, with a mask.

Every new shape a step sees is a new signature for each layer it reaches: traced,
compiled on each worker and cached there (`dd.compile_counts`). Padding to a handful of
bucket lengths keeps the number of signatures - and compilations - small while the
data changes length from batch to batch.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentError


__all__ = ["pad_to_bucket", "bucket_length"]


def bucket_length(length: int, buckets: int | Sequence[int]) -> int:
    """The smallest bucket >= `length`: `buckets` is a list of lengths, or an int for
    its multiples (``bucket_length(13, 8) == 16``)."""
    if isinstance(buckets, int) and not isinstance(buckets, bool):
        if buckets < 1:
            raise ArgumentError(f"pad_to_bucket: buckets={buckets} must be >= 1")
        return -(-length // buckets) * buckets
    sizes = sorted(int(b) for b in buckets)
    if not sizes:
        raise ArgumentError("pad_to_bucket: buckets is empty; give lengths or an int")
    for b in sizes:
        if b >= length:
            return b
    raise ArgumentError(f"pad_to_bucket: length {length} is longer than the largest bucket "
                        f"{sizes[-1]} (buckets {sizes}); add a larger bucket or truncate")


def pad_to_bucket(x: Any, buckets: int | Sequence[int], *, axis: int = 1, value: Any = 0,
                  lengths: Any = None) -> tuple[Any, Any]:
    """Pad `x` along `axis` to its bucket length; returns ``(padded, mask)``.

    `x` is an array or a pytree of arrays that share their length along `axis` (tokens
    and targets together). `mask` is a bool array of shape ``x.shape[:axis + 1]`` (e.g.
    (batch, length)), True at real positions; with `lengths` (one per row of axis 0)
    rows shorter than the batch's length are masked from their own length on. Pad
    values are `value`. The output is a JAX array where the input is one, else NumPy.
    """
    leaves = jax.tree_util.tree_leaves(x)
    if not leaves:
        raise ArgumentError("pad_to_bucket: x has no arrays")
    shapes = [np.shape(a) for a in leaves]
    if axis < 0:                        # counted from the end: the same axis of every array
        ndims = sorted({len(s) for s in shapes})
        if len(ndims) > 1 or axis < -ndims[0]:
            raise ArgumentError(f"pad_to_bucket: axis={axis} names different axes of arrays "
                                f"of shapes {shapes}; give it counted from the front")
        axis += ndims[0]
    if any(len(s) <= axis for s in shapes):
        raise ArgumentError(f"pad_to_bucket: axis={axis} but the arrays have shapes "
                            f"{shapes}")
    length = shapes[0][axis]
    if any(s[axis] != length for s in shapes):
        raise ArgumentError(f"pad_to_bucket: the arrays differ in length along axis {axis}: "
                            f"shapes {shapes}")
    target = bucket_length(length, buckets)

    def pad(a: Any) -> Any:
        widths = [(0, 0)] * np.ndim(a)
        widths[axis] = (0, target - length)
        if isinstance(a, jax.Array):
            return jnp.pad(a, widths, constant_values=value)
        return np.pad(np.asarray(a), widths, constant_values=value)

    padded = jax.tree_util.tree_map(pad, x)
    lead = shapes[0][:axis]
    positions = np.arange(target).reshape((1,) * axis + (target,))
    if lengths is None:
        mask = np.broadcast_to(positions < length, (*lead, target))
    else:
        rows = np.asarray(lengths).reshape((-1,) + (1,) * axis)
        if axis < 1 or rows.shape[0] != lead[0]:
            raise ArgumentError(f"pad_to_bucket: lengths gives {rows.shape[0]} rows, the "
                                f"arrays have {lead[0] if lead else 'no'} rows along axis 0 "
                                f"(and the padded axis must not be axis 0)")
        mask = np.broadcast_to(positions < np.minimum(rows, length), (*lead, target))
    mask = np.array(mask)
    if isinstance(leaves[0], jax.Array):
        mask = jnp.asarray(mask)
    return padded, mask
