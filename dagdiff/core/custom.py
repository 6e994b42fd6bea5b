"""`dd.custom_layer`: a layer from a hand-written forward and VJP rule (NumPy, CuPy, ...).

``fwd(*args) -> (out, residuals)`` and ``bwd(residuals, ct) -> cotangents`` (one per array
argument, None for non-differentiable ones such as integer labels). Recorded like any
`dd.layer` (one forward task, one VJP task); the residuals are plain arrays, so unlike JAX
pullbacks they serialize, and a VJP task may run on another worker without recomputing.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

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


class _ByCallback:
    """The JAX function of a custom layer without a JAX version (`jax_fn`): called on
    concrete arrays it runs `fwd`; traced by JAX (`jax.jit`, `jax.grad`, `jax.eval_shape`,
    a `dd.layer` calling it) it is a `jax.custom_vjp` whose forward and backward run the
    rules on the host through `jax.pure_callback`. Shapes come from running `fwd` once on
    zeros of the arguments' shapes (per signature); the backward runs `fwd` again for its
    residuals (JAX carries arrays only, a rule's residuals may be anything)."""

    def __init__(self, fwd: Callable[..., Any], bwd: Callable[..., Any],
                 name: str = "custom") -> None:
        self.fwd = fwd
        self.bwd = bwd
        self.name = name
        self._shapes: dict[Any, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            out, _ = fwd_result(self.fwd(*args, **kwargs), self.name)
            return out
        dyn = [i for i, x in enumerate(leaves) if _is_array(x)]
        avals = [jax.ShapeDtypeStruct(np.shape(leaves[i]), jnp.result_type(leaves[i]))
                 for i in dyn]
        out_shapes = self._out_shapes(leaves, treedef, dyn, avals)

        def rebuild(values: Sequence[Any]) -> tuple[Any, Any]:
            full = list(leaves)
            for i, v in zip(dyn, values):
                full[i] = v
            return jax.tree_util.tree_unflatten(treedef, full)

        def run_fwd(*values: Any) -> Any:
            a, k = rebuild(values)
            out, _ = fwd_result(self.fwd(*a, **k), self.name)
            return _as_shapes(out, out_shapes, self.name, "fwd")

        inexact = [bool(jnp.issubdtype(a.dtype, jnp.inexact)) for a in avals]
        ct_shapes = tuple(a for a, f in zip(avals, inexact) if f)

        def run_bwd(*values_and_ct: Any) -> Any:
            values, ct_leaves = values_and_ct[:len(dyn)], values_and_ct[len(dyn):]
            a, k = rebuild(values)
            _, res = fwd_result(self.fwd(*a, **k), self.name)
            ct = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shapes),
                                              list(ct_leaves))
            cts = _one_per_argument(self.name, self.bwd(res, ct), len(dyn))
            return tuple(_as_shapes(c, s, self.name, "bwd")
                         for c, s, f in zip(cts, avals, inexact) if f)

        @jax.custom_vjp
        def call(*values: Any) -> Any:
            return jax.pure_callback(run_fwd, out_shapes, *values, vmap_method="sequential")

        def call_fwd(*values: Any) -> tuple[Any, Any]:
            return call(*values), values

        def call_bwd(values: Any, ct: Any) -> tuple[Any, ...]:
            got = iter(jax.pure_callback(run_bwd, ct_shapes, *values,
                                         *jax.tree_util.tree_leaves(ct),
                                         vmap_method="sequential"))
            return tuple(next(got) if f else None for f in inexact)

        call.defvjp(call_fwd, call_bwd)
        return call(*[leaves[i] for i in dyn])

    def _out_shapes(self, leaves: list[Any], treedef: Any, dyn: list[int],
                    avals: list[Any]) -> Any:
        """The output's shapes for these arguments: `fwd` run once on zeros."""
        key = (treedef, tuple((a.shape, a.dtype) for a in avals),
               tuple(_static_key(leaves[i]) for i in range(len(leaves)) if i not in dyn))
        got = self._shapes.get(key)
        if got is None:
            concrete = list(leaves)
            for i, a in zip(dyn, avals):
                concrete[i] = np.zeros(a.shape, a.dtype)
            a, k = jax.tree_util.tree_unflatten(treedef, concrete)
            out, _ = fwd_result(self.fwd(*a, **k), self.name)
            got = jax.tree_util.tree_map(   # NumPy's float64 as JAX's float32 (no x64)
                lambda o: jax.ShapeDtypeStruct(
                    np.shape(o), jax.dtypes.canonicalize_dtype(np.asarray(o).dtype)), out)
            if len(self._shapes) < 256:
                self._shapes[key] = got
        return got

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_shapes"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._shapes = {}

    def __dask_tokenize__(self) -> Any:
        return ("dagdiff._ByCallback", tokenize(self.fwd, self.bwd, ensure_deterministic=False))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.core.Tracer, jax.Array, np.ndarray))


def _static_key(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return id(x)
    return x


def _as_shapes(value: Any, shapes: Any, name: str, rule: str) -> Any:
    """`value` (a rule's result) as NumPy arrays of `shapes`' structure, shapes and dtypes,
    or a CustomRuleError saying how it differs."""
    leaves = jax.tree_util.tree_leaves(value)
    want, tree = jax.tree_util.tree_flatten(shapes)
    if len(leaves) != len(want):
        raise CustomRuleError(
            f"custom layer {name!r}: {rule} returned {len(leaves)} arrays where "
            f"{len(want)} were expected ({tree})")
    out = []
    for v, w in zip(leaves, want):
        v = np.asarray(v)
        if v.shape != tuple(w.shape):
            raise CustomRuleError(
                f"custom layer {name!r}: {rule} returned an array of shape {list(v.shape)} "
                f"where {list(w.shape)} was expected (the shape it gave on zeros of the "
                "same arguments)")
        out.append(v.astype(w.dtype, copy=False))
    return jax.tree_util.tree_unflatten(tree, out)


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
              else _ByCallback(fwd, bwd, name or getattr(fwd, "__name__", "custom")))
        super().__init__(fn, name=name or getattr(fwd, "__name__", "custom"), stage=stage)

    def functions(self) -> tuple[Any, ...]:
        return (self.fwd_rule, self.bwd_rule, self.jax_fn)

    def _base_fingerprint(self) -> str:
        return tokenize(self.fwd_rule, self.bwd_rule, self.name, ensure_deterministic=False)

    def __repr__(self) -> str:
        return f"dd.custom_layer({self.name})"


def custom_layer(fwd: Callable[..., Any], bwd: Callable[..., Any], name: str | None = None, *,
                 jax_fn: Callable[..., Any] | None = None,
                 stage: int | None = None) -> CustomLayer:
    """Make a layer from rules ``fwd(*args) -> (out, residuals)`` and
    ``bwd(residuals, ct) -> cotangents``.

    `jax_fn` (optional) is a JAX-traceable equivalent - e.g. a `jax.custom_vjp` wrapper -
    used for shapes at trace time and wherever JAX traces the layer (`jax.jit`,
    `jax.grad`, another `dd.layer` calling it); without it, shapes come from running
    `fwd` on zeros, and where JAX traces the layer the rules run on the host through
    `jax.pure_callback` (the backward runs `fwd` again for its residuals). Array
    arguments reach the rules as JAX arrays (convert with `np.asarray`,
    or `cupy.from_dlpack` on a GPU); non-array arguments are static. `bwd` returns one
    cotangent per array leaf of the arguments, flat: an argument that is a pytree (a
    dict of arrays) gives one per leaf in ``jax.tree_util.tree_leaves`` order (a dict's
    keys sorted, not as written); a leaf's shape tells a wrong order only where shapes
    differ.
    """
    return CustomLayer(fwd, bwd, name=name, jax_fn=jax_fn, stage=stage)


def check_cotangents(layer: CustomLayer, cts: Any, primals: list[Any],
                     diff: tuple[bool, ...]) -> list[Any]:
    """Validate a bwd rule's result against the dynamic (array) arguments; return the
    cotangents of the differentiated ones, in order."""
    cts = _one_per_argument(layer.name, cts, len(primals))
    out = []
    for i, (ct, x, d) in enumerate(zip(cts, primals, diff)):
        if not d:
            continue
        if ct is None:
            raise CustomRuleError(f"custom layer {layer.name!r}: bwd returned None for "
                                  f"differentiable argument {i} ({_fmt(x)})")
        if not hasattr(ct, "dtype"):          # a list, a Python float: as NumPy reads it
            ct = np.asarray(ct)
        # the dtype JAX computes the argument in (float64 NumPy is float32 without x64);
        # a float cotangent of another precision (a rule computing in float32 for a
        # float16 argument) is cast to it, as the argument's gradient has its dtype
        want = jax.dtypes.canonicalize_dtype(x.dtype)
        if tuple(np.shape(ct)) == tuple(np.shape(x)) and np.dtype(ct.dtype) != want \
                and _floating(ct.dtype) and _floating(want):
            ct = jnp.asarray(ct).astype(want)
        if tuple(np.shape(ct)) != tuple(np.shape(x)) or np.dtype(ct.dtype) != want:
            raise CustomRuleError(
                f"custom layer {layer.name!r}: bwd returned a cotangent {_fmt(ct)} for "
                f"argument {i} of {_fmt(x)}; cotangents must have the argument's shape and "
                "dtype")
        out.append(ct)
    return out


def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _one_per_argument(name: str, cts: Any, n: int) -> tuple[Any, ...] | list[Any]:
    """A bwd rule's result as one cotangent per array argument, or a CustomRuleError."""
    if not isinstance(cts, (tuple, list)):
        cts = (cts,)
    if len(cts) != n:
        raise CustomRuleError(
            f"custom layer {name!r}: bwd returned {len(cts)} cotangents for {n} array "
            "arguments (array leaves: an argument that is a pytree, a dict or a list of "
            "arrays, counts one per leaf, in jax.tree_util.tree_leaves order, dict keys "
            "sorted); return one per array leaf (None for non-differentiable ones)")
    return cts


def _fmt(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
