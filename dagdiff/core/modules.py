"""Modules of the model libraries (Flax NNX, Flax Linen, Equinox) as dagdiff layers.

``dd.layer(module)`` gives a `ModuleLayer`, called like the module. Each call is one
layer call whose arguments are the module itself (a pytree: its arrays are dynamic
leaves, everything else static) and the call's arguments, so when the module comes
from the differentiated argument its arrays are traced parameters and get gradients.
A `ModuleLayer` is itself a pytree (and an NNX data type), so it can be stored inside
a model and traced with it. Sequential containers (`nnx.Sequential`,
`eqx.nn.Sequential`) record one layer call per element, so a pipeline can split them.

Flax Linen modules hold no arrays: ``dd.layer(linen_module)`` is a layer called as
``layer(variables, *args)``, i.e. ``module.apply``.

The libraries are optional: a module is recognised only if its library is already
imported (the user made the module), so dagdiff never imports them itself.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import jax

from ..errors import LayerTypeError
from .keys import sanitize
from .layer import Layer, register_maker
from .stage import check_stage
from .tracer import call_layer


__all__ = ["ModuleLayer", "library_of", "is_module", "module_layer", "linen_layer"]


def library_of(obj: Any) -> str | None:
    """"nnx", "linen" or "eqx" for a module of that library, else None (without importing
    a library that is not loaded)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(obj, nnx.Module):
        return "nnx"
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(obj, linen.Module):
        return "linen"
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(obj, eqx.Module):
        return "eqx"
    return None


def is_module(obj: Any) -> bool:
    """True for an NNX or Equinox module: a model object that holds its own arrays."""
    return library_of(obj) in ("nnx", "eqx")


def _sequence(module: Any) -> tuple[Any, ...] | None:
    """The elements of a sequential container, called in order; None for other modules."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and type(module) is nnx.Sequential:
        return tuple(module.layers)
    eqx = sys.modules.get("equinox")
    if eqx is not None and type(module) is eqx.nn.Sequential:
        return tuple(module.layers)
    return None


def _call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
    """What a module's layer runs: the module called on the arguments, refusing one that
    changes its own state (an NNX BatchNorm in training mode, an NNX Dropout drawing from
    its RNG stream): a layer is a pure function, so the change would be lost."""
    if library_of(module) != "nnx":
        return module(*args, **kwargs)
    before = jax.tree_util.tree_leaves(module)
    out = module(*args, **kwargs)
    after = jax.tree_util.tree_leaves(module)
    if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
        raise LayerTypeError(_mutation_message(module, before))
    return out


def _mutation_message(module: Any, before: list[Any]) -> str:
    nnx = sys.modules["flax.nnx"]
    changed = []
    flat = jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    pos = 0
    for path, var in flat:
        n = len(jax.tree_util.tree_leaves(var))
        new = jax.tree_util.tree_leaves(var)
        if any(a is not b for a, b in zip(before[pos:pos + n], new)):
            changed.append(f"{jax.tree_util.keystr(path)} ({type(var).__name__})")
        pos += n
    return (f"the NNX module {type(module).__name__} changes its own state when called: "
            f"{', '.join(changed) or 'its variables'}. A dagdiff layer is a pure function "
            "run on a worker, so that update would be lost; this is not supported. Call it "
            "in inference mode for those parts (model.eval(), BatchNorm("
            "use_running_average=True), Dropout(deterministic=True)), or draw dropout from a "
            "key passed to the layer as an argument (nnx.Dropout(...)(x, rngs=nnx.Rngs(key)))")


@functools.lru_cache(maxsize=1024)
def _inner(name: str, remat: bool, stage: int | None) -> Layer:
    """The layer that records a module call (one per name, remat and stage, so repeated
    steps hit every cache keyed by the layer)."""
    return Layer(_call_module, name=name, remat=remat, stage=stage)


class ModuleLayer(Layer):
    """An NNX or Equinox module as a layer: ``layer(*args)`` records
    ``module(*args)`` as one forward task and one VJP task (a sequential container: one
    per element) whose dynamic arguments are the module's arrays and `args`.

    `layer.module` is the module; the layer is a pytree with the module as its child, so
    a model holding it is traced (and differentiated) through it.
    """

    def __init__(self, module: Any, name: str | None = None, remat: bool = False,
                 stage: int | None = None) -> None:
        self.module = module
        self.name = sanitize(name or type(module).__name__.lower())
        self.remat = bool(remat)
        self.stage = check_stage(stage, f"stage of layer {self.name!r}")
        self.fn = _call_module
        self._fingerprint = None
        parts = _sequence(module)
        self._calls: tuple[tuple[Layer, Any], ...] = (
            ((_inner(self.name, self.remat, self.stage), module),) if parts is None else
            tuple((_inner(f"{self.name}_{i}", self.remat, self.stage), p)
                  for i, p in enumerate(parts)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self._calls) == 1:
            inner, module = self._calls[0]
            return call_layer(inner, (module, *args), kwargs)
        if len(args) != 1 or kwargs:
            raise LayerTypeError(
                f"layer {self.name!r} (a {type(self.module).__name__} of "
                f"{len(self._calls)} parts) takes one positional argument, which each part "
                f"hands to the next; got {len(args)} positional and {sorted(kwargs)} keyword "
                "arguments. Wrap the parts with dd.layer one by one instead.")
        x = args[0]
        for inner, part in self._calls:
            x = call_layer(inner, (part, x), {})
        return x

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModuleLayer, (self.module, self.name, self.remat, self.stage))

    def __copy__(self) -> "ModuleLayer":
        return ModuleLayer(self.module, self.name, self.remat, self.stage)

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModuleLayer":
        import copy
        return ModuleLayer(copy.deepcopy(self.module, memo), self.name, self.remat,
                           self.stage)

    def __repr__(self) -> str:
        extra = "".join([", remat=True" if self.remat else "",
                         f", stage={self.stage}" if self.stage is not None else ""])
        return f"dd.layer({type(self.module).__name__} as {self.name}{extra})"


def _flatten(layer: ModuleLayer) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return ((jax.tree_util.GetAttrKey("module"), layer.module),), (
        layer.name, layer.remat, layer.stage)


def _unflatten(aux: tuple[Any, ...], children: Any) -> ModuleLayer:
    (module,) = children
    return ModuleLayer(module, *aux)


jax.tree_util.register_pytree_with_keys(
    ModuleLayer, _flatten, _unflatten,
    flatten_func=lambda l: ((l.module,), (l.name, l.remat, l.stage)))


_NNX_REGISTERED = False


def register_with_nnx() -> None:
    """Let NNX modules hold a `ModuleLayer` as an attribute (a data value with arrays)."""
    global _NNX_REGISTERED
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and not _NNX_REGISTERED:
        nnx.register_data_type(ModuleLayer)
        _NNX_REGISTERED = True


def module_layer(module: Any, name: str | None, remat: bool, stage: int | None
                 ) -> Layer | None:
    """`dd.layer` of a model library's module instance (None for anything else)."""
    kind = library_of(module)
    if kind is None:
        return None
    if kind == "linen":
        return linen_layer(module, name, remat, stage)
    register_with_nnx()
    return ModuleLayer(module, name=name, remat=remat, stage=stage)


register_maker(module_layer)


def linen_layer(module: Any, name: str | None, remat: bool, stage: int | None) -> Layer:
    """A Flax Linen module as a layer called ``layer(variables, *args, **kwargs)``:
    ``module.apply`` (the variables are its parameters when they are differentiated)."""
    return Layer(functools.partial(_apply_linen, module),
                 name=name or type(module).__name__.lower(), remat=remat, stage=stage)


def _apply_linen(module: Any, variables: Any, *args: Any, **kwargs: Any) -> Any:
    return module.apply(variables, *args, **kwargs)

