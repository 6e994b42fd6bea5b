"""`dd.custom_layer`: a layer from a hand-written forward and VJP rule (NumPy, CuPy, ...).

``fwd(*args) -> (out, residuals)`` and ``bwd(residuals, ct) -> cotangents`` (one per array
argument, None for non-differentiable ones such as integer labels). Recorded like any
`dd.layer` (one forward task, one VJP task); the residuals are plain arrays, so unlike JAX
pullbacks they serialize, and a VJP task may run on another worker without recomputing.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from dask.base import tokenize

from ..errors import ArgumentError, CustomRuleError
from .layer import Layer


__all__ = ["CustomLayer", "custom_layer", "check_cotangents", "fwd_result"]


def fwd_result(result: Any, name: str) -> tuple[Any, Any]:
    """(out, residuals) from what a fwd rule returned, or a CustomRuleError saying why not."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        what = (f"a {len(result)}-tuple" if isinstance(result, tuple)
                else type(result).__name__)
        raise CustomRuleError(
            f"custom layer {name!r}: fwd must return (out, residuals), got {what}; return "
            "e.g. (y, (x, w)) - the residuals are what bwd(residuals, ct) needs")
    return result[0], result[1]


class _ShapeByRunning:
    """The eager function of a custom layer without a JAX version: runs `fwd` (on zeros of
    the right shapes when JAX traces it, e.g. for `jax.eval_shape` at trace time)."""

    def __init__(self, fwd: Callable[..., Any], name: str = "custom") -> None:
        self.fwd = fwd
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            concrete = [np.zeros(x.shape, x.dtype) if isinstance(x, jax.core.Tracer) else x
                        for x in leaves]
            a, k = jax.tree_util.tree_unflatten(treedef, concrete)
            out, _ = fwd_result(self.fwd(*a, **k), self.name)

            return jax.tree_util.tree_map(lambda o: jnp.zeros(np.shape(o), np.asarray(o).dtype),
                                          out)
        out, _ = fwd_result(self.fwd(*args, **kwargs), self.name)
        return out

    def __dask_tokenize__(self) -> Any:
        return ("dagdiff._ShapeByRunning", tokenize(self.fwd, ensure_deterministic=False))


class CustomLayer(Layer):
    """A layer whose forward and VJP are hand-written rules instead of JAX autodiff."""

    custom = True

    def __init__(self, fwd: Callable[..., Any], bwd: Callable[..., Any], name: str | None = None,
                 jax_fn: Callable[..., Any] | None = None, stage: int | None = None) -> None:
        if not callable(fwd) or not callable(bwd):
            raise ArgumentError("dd.custom_layer needs callable fwd and bwd rules")
        self.fwd_rule = fwd
        self.bwd_rule = bwd
        self.jax_fn = jax_fn
        fn = (jax_fn if jax_fn is not None
              else _ShapeByRunning(fwd, name or getattr(fwd, "__name__", "custom")))
        super().__init__(fn, name=name or getattr(fwd, "__name__", "custom"), stage=stage)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = tokenize(self.fwd_rule, self.bwd_rule, self.name,
                                         ensure_deterministic=False)
        return self._fingerprint

    def __repr__(self) -> str:
        return f"dd.custom_layer({self.name})"


def custom_layer(fwd: Callable[..., Any], bwd: Callable[..., Any], name: str | None = None, *,
                 jax_fn: Callable[..., Any] | None = None,
                 stage: int | None = None) -> CustomLayer:
    """Make a layer from rules ``fwd(*args) -> (out, residuals)`` and
    ``bwd(residuals, ct) -> cotangents``.

    `jax_fn` (optional) is a JAX-traceable equivalent - e.g. a `jax.custom_vjp` wrapper -
    used for shapes at trace time and when the layer is called outside tracing (so
    `jax.grad` of a model using it works); without it, shapes come from running `fwd`
    on zeros. Array arguments reach the rules as JAX arrays (convert with `np.asarray`,
    or `cupy.from_dlpack` on a GPU); non-array arguments are static.
    """
    return CustomLayer(fwd, bwd, name=name, jax_fn=jax_fn, stage=stage)


def check_cotangents(layer: CustomLayer, cts: Any, primals: list[Any],
                     diff: tuple[bool, ...]) -> list[Any]:
    """Validate a bwd rule's result against the dynamic (array) arguments; return the
    cotangents of the differentiated ones, in order."""
    if not isinstance(cts, (tuple, list)):
        cts = (cts,)
    if len(cts) != len(primals):
        raise CustomRuleError(
            f"custom layer {layer.name!r}: bwd returned {len(cts)} cotangents for "
            f"{len(primals)} array arguments; return one per array argument (None for "
            "non-differentiable ones)")
    out = []
    for i, (ct, x, d) in enumerate(zip(cts, primals, diff)):
        if not d:
            continue
        if ct is None:
            raise CustomRuleError(f"custom layer {layer.name!r}: bwd returned None for "
                                  f"differentiable argument {i} ({_fmt(x)})")
        if tuple(np.shape(ct)) != tuple(np.shape(x)) or np.dtype(ct.dtype) != np.dtype(x.dtype):
            raise CustomRuleError(
                f"custom layer {layer.name!r}: bwd returned a cotangent {_fmt(ct)} for "
                f"argument {i} of {_fmt(x)}; cotangents must have the argument's shape and "
                "dtype")
        out.append(ct)
    return out


def _fmt(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
