"""Differentiated arguments in a model library's form (a Flax NNX or Equinox module).

`ModelForm.of(model)` splits a module into the arrays dagdiff differentiates (the
`params()` dict, keyed by readable paths such as ``blocks_0_lin_kernel``) and the rest,
held fixed: NNX's non-`Param` variables (batch statistics, RNG state) and Equinox's
non-float leaves (activation functions, integer arrays). `rebuild` puts a module back
together from such a dict (traced values while tracing, new values after training) and
`grads` gives gradients in the library's own form: an `nnx.State` of the `Param`
variables, as `nnx.value_and_grad` returns; a module-shaped pytree with None where
nothing is differentiated, as `eqx.filter_value_and_grad` returns.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..errors import ArgumentError
from .keys import sanitize
from .modules import library_of, register_with_nnx
from .tracer import is_array


__all__ = ["ModelForm", "lower_args"]


def _inexact(x: Any) -> bool:
    # jax's issubdtype reads its extended dtypes too (a typed PRNG key, held fixed), where
    # NumPy's result_type raised "Cannot interpret 'key<fry>' as a data type"
    return is_array(x) and bool(jax.dtypes.issubdtype(x.dtype, np.inexact))


@dataclass(frozen=True, eq=False)
class ModelForm:
    """How one module argument is traced and given back (see the module docstring)."""

    library: str                       # "nnx" or "eqx"
    treedef: Any                       # of the whole module
    leaves: tuple[Any, ...]            # its leaves as given
    names: tuple[str | None, ...]      # per leaf: its key in `params()`; None: held fixed
    cls: str                           # the module's class name, for messages

    @classmethod
    def of(cls, obj: Any) -> "ModelForm | None":
        """The form of an NNX or Equinox module, or of a list, tuple or dict holding
        Equinox modules (a model as a list of blocks); None for any other value."""
        kind = library_of(obj)
        name = type(obj).__name__
        if kind is None and _holds_eqx(obj):
            kind, name = "eqx", f"{name} of Equinox modules"
        if kind not in ("nnx", "eqx"):
            return None
        register_with_nnx()
        flat, treedef = jax.tree_util.tree_flatten_with_path(obj)
        if kind == "nnx":
            _check_unshared(obj, len(flat))
        trainable = _nnx_params(obj, len(flat)) if kind == "nnx" else [True] * len(flat)
        names: list[str | None] = []
        seen: set[str] = set()
        for (path, leaf), ok in zip(flat, trainable):
            if not (ok and _inexact(leaf)):
                names.append(None)
                continue
            name = sanitize(jax.tree_util.keystr(path)) or "param"
            base, k = name, 1
            while name in seen:
                name, k = f"{base}_{k}", k + 1
            seen.add(name)
            names.append(name)
        return cls(kind, treedef, tuple(x for _, x in flat), tuple(names), name)

    def without_params(self) -> "ModelForm":
        """This form without the parameters' values (enough to `rebuild`)."""
        return dataclasses.replace(self, leaves=tuple(
            None if n is not None else x for n, x in zip(self.names, self.leaves)))

    def params(self) -> dict[str, Any]:
        """The differentiated arrays, by name."""
        return {n: x for n, x in zip(self.names, self.leaves) if n is not None}

    def rebuild(self, params: Mapping[str, Any]) -> Any:
        """The module with its differentiated arrays taken from `params` (by name)."""
        try:
            leaves = [x if n is None else params[n] for n, x in zip(self.names, self.leaves)]
        except KeyError as e:
            raise KeyError(f"no value for parameter {e.args[0]!r} of the {self.cls} "
                           f"module (it has {sorted(self.params())})") from None
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def grads(self, grads: Mapping[str, Any]) -> Any:
        """Gradients in the library's form: an `nnx.State` of the Params (NNX), or a
        module-shaped pytree with None for leaves not differentiated (Equinox)."""
        if self.library == "nnx":
            nnx = sys.modules["flax.nnx"]
            leaves = [None if n is None else grads.get(n) for n in self.names]
            return nnx.state(jax.tree_util.tree_unflatten(self.treedef, leaves), nnx.Param)
        return jax.tree_util.tree_unflatten(
            self.treedef, [None if n is None else grads.get(n) for n in self.names])


def _holds_eqx(obj: Any) -> bool:
    """Whether `obj`, a list, tuple or dict, holds an Equinox module at any depth."""
    if not isinstance(obj, (list, tuple, dict)) or "equinox" not in sys.modules:
        return False
    nodes = jax.tree_util.tree_leaves(obj, is_leaf=lambda x: library_of(x) == "eqx")
    return any(library_of(x) == "eqx" for x in nodes)


def _check_unshared(module: Any, n: int) -> None:
    """Refuse an NNX module that holds one variable or submodule in two places: as a
    pytree it would become two copies with two gradients, where NNX sums them."""
    nnx = sys.modules["flax.nnx"]
    unique = len(jax.tree_util.tree_leaves(nnx.state(module)))
    if unique != n:
        raise ArgumentError(
            f"the {type(module).__name__} module shares variables between submodules "
            f"({n} array leaves as a pytree, {unique} distinct in nnx.state): dagdiff traces "
            "a differentiated module as a pytree, which would give each place its own copy "
            "and gradient. Not supported yet: tie the weights explicitly (pass the shared "
            "array to both layers as an argument), or give each place its own variable")


def _nnx_params(module: Any, n: int) -> list[bool]:
    """Per array leaf of an NNX module: does it belong to an `nnx.Param` (what
    `nnx.grad` differentiates by default)?"""
    nnx = sys.modules["flax.nnx"]
    out: list[bool] = []
    for var in jax.tree_util.tree_leaves(module, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        count = len(jax.tree_util.tree_leaves(var)) if isinstance(var, nnx.Variable) else 1
        out.extend([isinstance(var, nnx.Param)] * count)
    if len(out) != n:                # an unexpected layout: differentiate by dtype only
        return [True] * n
    return out


def lower_args(fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int]
               ) -> tuple[Callable[..., Any], list[Any], dict[int, ModelForm]]:
    """Replace each differentiated module argument by its `params()` dict, and `fn` by a
    function that rebuilds the modules before calling it; `forms` maps the argument's
    position to its form (empty when no argument is a module)."""
    forms = {i: f for i in argnums if (f := ModelForm.of(args[i])) is not None}
    if not forms:
        return fn, list(args), {}
    new = [forms[i].params() if i in forms else a for i, a in enumerate(args)]
    # what the rebuilding closure keeps: the fixed leaves only (the parameters always come
    # from its arguments), so a loss run whole as one layer does not carry the model
    lean = {i: f.without_params() for i, f in forms.items()}

    @functools.wraps(fn)
    def on_params(*a: Any, **kw: Any) -> Any:
        return fn(*[lean[i].rebuild(x) if i in lean else x for i, x in enumerate(a)], **kw)

    return on_params, new, forms
