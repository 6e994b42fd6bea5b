"""`CallSpec`: everything a worker needs to run one layer signature (function, layout, avals)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import jax
from dask.base import tokenize

from .pytrees import PytreeClass, pytree_classes, register_all


__all__ = ["CallSpec", "make_call_spec"]


@dataclass(frozen=True, eq=False)
class CallSpec:
    """Everything a worker needs to run one layer signature: function, argument layout,
    which dynamic leaves are differentiated, output avals, and a stable fingerprint."""

    layer: Any
    name: str
    fingerprint: str
    in_template: Any                # the arguments' pytree with `_LEAF` at every leaf
    kinds: tuple[str, ...]          # per argument leaf: "d" dynamic array, "s" static
    statics: tuple[Any, ...]        # static leaf values (None where dynamic)
    diff: tuple[bool, ...]          # per dynamic leaf: differentiated?
    out_avals: tuple[jax.ShapeDtypeStruct, ...] = ()
    remat: bool = False             # forward keeps no residuals; the VJP task recomputes
    checkpoint: str = ""            # "selective": `jax.checkpoint` keeping dots (`core.remat`)
    #: the pytree classes of its arguments and outputs that travel by value (a notebook's),
    #: registered with JAX again where the spec is unpickled
    pytree_classes: tuple[PytreeClass, ...] = ()

    @property
    def in_treedef(self) -> Any:
        """The arguments' treedef, rebuilt from `in_template` once per process: treedefs of
        some libraries' pytrees (equinox) do not survive pickling, their objects do."""
        td = self.__dict__.get("_treedef")
        if td is None:
            td = jax.tree_util.tree_structure(self.in_template)
            object.__setattr__(self, "_treedef", td)
        return td

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_treedef", "_plain")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        register_all(state.get("pytree_classes", ()))

    def call(self, dyn: Sequence[Any]) -> Any:
        """Run the layer function on dynamic leaves `dyn` (statics filled in), under
        `jax.checkpoint` when the spec's policy is selective."""
        if self.checkpoint:
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            return jax.checkpoint(self._call, policy=policy)(list(dyn))
        return self._call(dyn)

    def _call(self, dyn: Sequence[Any]) -> Any:
        it = iter(dyn)
        leaves = [next(it) if k == "d" else s for k, s in zip(self.kinds, self.statics)]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_treedef, leaves)
        return self.layer.fn(*args, **kwargs)

    def with_outputs(self, out_avals: tuple[jax.ShapeDtypeStruct, ...],
                     in_avals: Sequence[Any] = (), out_treedef: Any = None) -> "CallSpec":
        """This spec with its output avals; they and the dynamic inputs' avals are part of
        the fingerprint, so one fingerprint is one compiled signature (a new sequence
        length is a new one, counted by `dd.compile_counts`). `out_treedef`: the outputs'
        structure, whose by-value pytree classes the spec carries too."""
        sig = (tuple((a.shape, str(a.dtype)) for a in out_avals),
               tuple((tuple(a.shape), str(a.dtype)) for a in in_avals))
        classes = self.pytree_classes
        if out_treedef is not None:
            known = {c.cls for c in classes}
            classes += tuple(c for c in pytree_classes(out_treedef) if c.cls not in known)
        new = dataclasses.replace(self, out_avals=out_avals, pytree_classes=classes,
                                  fingerprint=f"{self.fingerprint}-{tokenize(sig)[:8]}")
        object.__setattr__(new, "_treedef", self.__dict__.get("_treedef"))
        return new

    @property
    def n_diff(self) -> int:
        return sum(self.diff)


def make_call_spec(layer: Any, treedef: Any, kinds: tuple[str, ...], statics: tuple[Any, ...],
                   diff: tuple[bool, ...]) -> CallSpec:
    """Build a `CallSpec`, fingerprinting function, layout and statics once."""
    fp = tokenize(layer.fingerprint, str(treedef), kinds, statics, diff,
                  ensure_deterministic=False)
    template = jax.tree_util.tree_unflatten(treedef, [_LEAF] * treedef.num_leaves)
    spec = CallSpec(layer, layer.name, f"{layer.name}-{fp}", template, kinds, statics, diff,
                    remat=layer.remat, pytree_classes=pytree_classes(treedef))
    object.__setattr__(spec, "_treedef", treedef)
    return spec


class _Leaf:
    """Placeholder leaf of `CallSpec.in_template`."""

    def __repr__(self) -> str:
        return "*"


_LEAF = _Leaf()
