"""Tracing a user's loss function: arguments become traced inputs, the loss is checked."""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..errors import ArgumentError, DagdiffError, TracerError
from .layer import Layer
from .ops import OPERATOR_LAYERS
from .tracer import Trace, Traced, fmt_aval, is_array


__all__ = ["trace_call", "argnums_of", "argnames", "is_input", "split_aux", "check_loss"]

log = logging.getLogger(__name__)

#: names of loss functions already told that they run as one layer
_SAID_WHOLE: set[str] = set()


def argnums_of(argnums: int | Sequence[int], n: int, fname: str,
               option: str = "argnums") -> tuple[int, ...]:
    """Validated, non-negative argument indices for a call with `n` positional arguments."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not isinstance(a, int) or isinstance(a, bool) or not -n <= a < n:
            raise ArgumentError(
                f"{fname}: {option}={argnums!r} but it was called with {n} positional "
                f"arguments; give indices in {-n}..{n - 1}")
    return tuple(a % n for a in nums)


def trace_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               argnums: tuple[int, ...], name: str) -> tuple[Trace, Any, list[Any]]:
    """Run `fn` once under a new trace; array leaves of args become traced inputs.

    Returns the trace, fn's output, and the traced differentiated arguments.
    """
    trace = Trace(name)
    targs = []
    names = argnames(fn, len(args))
    with trace:
        for i, a in enumerate(args):
            leaves, td = jax.tree_util.tree_flatten_with_path(a)
            new = [trace.add_input(x, _path(names[i], p), i in argnums) if is_input(x) else x
                   for p, x in leaves]
            targs.append(jax.tree_util.tree_unflatten(td, new))
        if argnums and not any(n.kind == "param" for n in trace.nodes):
            got = []
            for i in argnums:
                leaves = jax.tree_util.tree_leaves(args[i])
                kinds = sorted({fmt_aval(x) if is_array(x) else type(x).__name__
                                for x in leaves})[:4]
                got.append(f"argument {names[i]!r} (position {i}) holds "
                           f"{', '.join(kinds) or 'no leaves'}")
            raise TracerError(
                f"{name}: nothing to differentiate: {'; '.join(got)}, and no floating-point "
                "array. The differentiated argument(s) must be a pytree of float arrays "
                "(e.g. the params); integer leaves get no gradient (as with jax.grad, which "
                "refuses them). Cast the parameters to float (x.astype(jnp.float32)), or pick "
                "argnums=")
        tkw = {k: jax.tree_util.tree_map(
            lambda x: trace.add_input(x, f"kw_{k}", False) if is_array(x) else x, v)
            for k, v in kwargs.items()}
        try:
            out = fn(*targs, **tkw)
        except (TypeError, ValueError) as e:
            text = str(e)
            needs_data = isinstance(e, TracerError) and hasattr(e, "value")
            if not needs_data and (isinstance(e, DagdiffError)
                                   or not ("__jax_array__" in text or "Traced" in text)):
                raise
            if not isinstance(fn, Layer) and all(n.layer in OPERATOR_LAYERS
                                                 for n in trace.nodes if n.kind == "call"):
                # plain JAX (a model's own __call__), no dd.layer anywhere: the whole
                # function is one layer, as jax.value_and_grad would see it
                if name not in _SAID_WHOLE:             # once per function name
                    _SAID_WHOLE.add(name)
                    log.warning("dagdiff: %s calls no dd.layer, so it runs as one layer "
                                "(one forward and one VJP task); wrap its parts with "
                                "dd.layer to split it into tasks and stages", name)
                whole = Layer(fn, name=name)
                return trace_call(whole, args, kwargs, argnums, name)
            if needs_data:
                raise
            raise TracerError(
                f"{name}: a JAX/NumPy function was applied to a traced value outside any "
                f"dd.layer ({type(e).__name__}: {text.splitlines()[0]}). Traced values have "
                "no data while dagdiff traces; move that computation into a function wrapped "
                "in dd.layer."
            ) from e
    return trace, out, [targs[i] for i in argnums]


def is_input(x: Any) -> bool:
    """Array leaves, and ShapeDtypeStruct placeholders (microbatches built later)."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _path(argname: str, path: Any) -> str:
    parts = [argname]
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "_".join(parts)


def argnames(fn: Callable[..., Any], n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]


def split_aux(out: Any, has_aux: bool, fname: str) -> tuple[Any, Any]:
    """(loss, aux) from what the loss function returned."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        what = (f"a {len(out)}-tuple" if isinstance(out, tuple) else
                fmt_aval(out.aval) if isinstance(out, Traced) else type(out).__name__)
        raise TracerError(f"{fname} with has_aux=True must return a 2-tuple (loss, aux), got "
                          f"{what}; return (loss, aux) or drop has_aux=True")
    return out


def check_loss(loss: Any, trace: Trace, fname: str, aux: bool = True) -> Traced:
    """The loss `fname` returned, checked: a traced float scalar of `trace`. `aux`: the
    caller takes ``has_aux=True`` (`dd.Trainer` does not)."""
    if isinstance(loss, tuple) and len(loss) == 2 and isinstance(loss[0], Traced):
        raise TracerError(
            f"{fname} returned a 2-tuple, not a scalar loss; if the second item is auxiliary "
            "output, pass has_aux=True (it returns (loss, aux) then)" if aux else
            f"{fname} returned a 2-tuple, not a scalar loss; dd.Trainer trains on a loss "
            "function that returns the loss alone: return the loss (e.g. a wrapper "
            "`lambda *a: loss_fn(*a)[0]`), and get auxiliary outputs from "
            "dd.value_and_grad(loss_fn, has_aux=True) when you need them")
    if not isinstance(loss, Traced) or loss.trace is not trace:
        raise TracerError(
            f"{fname} must return a traced scalar (the output of a dd.layer call), got "
            f"{type(loss).__name__}. Compute the loss inside a dd.layer."
        )
    if loss.shape != () or not jax.dtypes.issubdtype(loss.dtype, np.floating):
        raise TracerError(
            f"{fname} must return a real scalar loss, got {fmt_aval(loss.aval)}; reduce it "
            "(e.g. jnp.mean) inside the loss layer."
        )
    return loss
