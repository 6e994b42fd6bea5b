"""Non-array layer arguments travel to the workers inside the step's tasks: check that
they pickle before Dask tries, and name the layer, its stage and the argument when not."""
from __future__ import annotations

import inspect
from typing import Any

import cloudpickle
import jax

from ..core.tracer import Trace
from ..errors import LayerTypeError


__all__ = ["check_shippable"]

_PLAIN = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), slice)
_checked: dict[tuple[int, int], bool] = {}          # (id of spec, leaf) -> picklable
_layers_ok: dict[str, bool] = {}                    # a layer's payload digest -> rebuilt


def _check_layer(spec: Any, node: Any) -> None:
    """Rebuild `spec`'s layer from the bytes it travels as (`core.byvalue`), once per
    payload: a function that pickles but does not unpickle (a ``jax.custom_vjp`` object,
    an object whose ``__reduce__`` raises) fails here, on the client, with its name."""
    layer = getattr(spec, "layer", None)
    reduce = getattr(layer, "__reduce__", None)
    if layer is None or reduce is None:
        return
    try:
        rebuild, args = reduce()
    except Exception as e:                          # noqa: BLE001 - the pickling itself
        raise _unshippable(spec, node, "cannot be pickled", e) from None
    if not (isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], bytes)):
        return                                      # not a by-value payload
    digest = str(args[0])
    if _layers_ok.get(digest):
        return
    try:
        cloudpickle.loads(args[1])                  # not `rebuild`: it would hit the cache
    except Exception as e:                          # noqa: BLE001 - any unpickling failure
        raise _unshippable(spec, node, "pickles but cannot be rebuilt from its bytes",
                           e) from None
    if len(_layers_ok) > 4096:
        _layers_ok.clear()
    _layers_ok[digest] = True


def _unshippable(spec: Any, node: Any, what: str, e: BaseException) -> LayerTypeError:
    return LayerTypeError(
        f"layer {spec.name!r} (call {node.index}, stage {node.stage}) {what} "
        f"({type(e).__name__}: {str(e)[:300]}), so no worker could run it: distributed "
        "drops a worker whose task does not deserialize. Its function, or something it "
        "uses (a jax.custom_vjp / custom_jvp function, an object with its own __reduce__), "
        "travels by value from here, and such an object does not round-trip (defined in a "
        "module the workers import, too: a jax.custom_vjp pickles by value). Make it inside "
        "the layer's function (it is then built where the layer runs), write the rule as "
        "dd.custom_layer(fwd, bwd), or compute on local threads (no distributed client).")


def check_shippable(trace: Trace) -> None:
    """Raise `LayerTypeError` for the first layer of `trace` whose function cannot be
    rebuilt from its pickled bytes (a worker could not read the step: distributed drops
    a worker whose task does not deserialize), and for the first static (non-array)
    argument of a layer call that cannot be pickled (a lock, an open file, a client)."""
    for node in trace.nodes:
        spec = node.spec
        if spec is None:
            continue
        _check_layer(spec, node)
        for i, (kind, value) in enumerate(zip(spec.kinds, spec.statics)):
            if kind != "s" or _plain(value):
                continue
            memo = (id(spec), i)
            if _checked.get(memo):
                continue
            try:
                cloudpickle.dumps(value)
            except Exception as e:                 # noqa: BLE001 - any pickling failure
                raise LayerTypeError(
                    f"layer {spec.name!r} (call {node.index}, stage {node.stage}) got a "
                    f"non-array argument {_argument(spec, i)} = {_short(value)} "
                    f"({type(value).__module__}.{type(value).__qualname__}) that cannot be "
                    f"pickled ({type(e).__name__}: {e}). On a cluster every non-array "
                    "argument travels to the workers with the step: keep process-local "
                    "objects (locks, open files, clients) out of layer arguments (make them "
                    "on the worker, e.g. a module-level global), pass data as arrays, or "
                    "compute on local threads (no distributed client).") from None
            if len(_checked) > 4096:
                _checked.clear()
            _checked[memo] = True


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return False


def _argument(spec: Any, leaf: int) -> str:
    """Which argument of the layer holds leaf `leaf`: its name and, inside a pytree, the
    leaf's path."""
    marks = list(range(len(spec.kinds)))
    try:
        args, kwargs = jax.tree_util.tree_unflatten(spec.in_treedef, marks)
    except Exception:                               # noqa: BLE001 - another layout
        return f"(argument leaf {leaf})"
    try:
        params = list(inspect.signature(spec.layer.fn).parameters)
    except (TypeError, ValueError, AttributeError):
        params = []
    for pos, a in enumerate(args):
        if leaf in jax.tree_util.tree_leaves(a):
            name = params[pos] if pos < len(params) else f"#{pos}"
            return f"{name!r} (positional argument {pos})"
    for k, v in kwargs.items():
        if leaf in jax.tree_util.tree_leaves(v):
            return f"{k!r} (keyword argument)"
    return f"(argument leaf {leaf})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
