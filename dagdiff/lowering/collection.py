"""The Dask collections a step's outputs are: `StepDelayed` (a Delayed whose outputs
computed together wait for their own worker's program alone) and `DelayedTree` (a pytree
with Delayed leaves as one collection, so `dask.compute` gives it back in its own type:
an `nnx.State`, an Equinox module, which Dask cannot walk into by itself)."""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import dask
import jax
from dask.base import DaskMethodsMixin
from dask.delayed import Delayed
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from ..errors import ArgumentError
from ..runtime.direct.graph import own_output, own_outputs
from ..runtime.plugins import known_keys


__all__ = ["StepDelayed", "DelayedTree", "needs_collection", "optimize", "OWN_OUTPUTS_KEY"]

#: dask config key: outputs of a step computed together wait for their own program alone
OWN_OUTPUTS_KEY = "dagdiff.direct.own-outputs"


#: output keys last submitted waiting for their own program alone (`optimize`), newest
#: last: a key the scheduler still has keeps that form when computed again (it warns of
#: a key submitted again with other dependencies)
_OWN_FORM: collections.OrderedDict[str, None] = collections.OrderedDict()
_OWN_FORM_SIZE = 4096


def optimize(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's low-level optimization of step outputs computed in one call (`dask.compute`,
    `Client.compute`, `persist`: Dask hands every collection of one optimizer the keys of
    all of them at once; distributed materializes the graph on its scheduler):
    Delayed's (cull), then, in each direct-dispatch layer, the outputs that may wait for
    their own worker's program alone do (`dagdiff.runtime.direct.graph.own_outputs`: a
    fresh run of their step, whose programs all run anyway), unless dask config
    ``dagdiff.direct.own-outputs`` is False or no scheduler runs in this process. A key
    the scheduler still has keeps the form it was submitted in."""
    graph = Delayed.__dask_optimize__(dsk, keys, **kwargs)
    if not dask.config.get(OWN_OUTPUTS_KEY, True) or not isinstance(graph, HighLevelGraph):
        return graph
    wanted = [k for k in flatten(keys) if isinstance(k, str)]
    layers, changed = dict(graph.layers), False
    for name, layer in graph.layers.items():
        mapping = dict(layer)
        known = known_keys(mapping)
        if known is None:
            return graph
        mine = own_outputs(mapping, [k for k in wanted if k in mapping], known)
        for k in known & _OWN_FORM.keys():
            if (t := own_output(mapping, k)) is not None:
                mine[k] = t
        if mine:
            for k in mine:
                _OWN_FORM[k] = None
                _OWN_FORM.move_to_end(k)
            while len(_OWN_FORM) > _OWN_FORM_SIZE:
                _OWN_FORM.popitem(last=False)
            mapping.update(mine)
            layers[name] = MaterializedLayer(mapping, annotations=layer.annotations)
            changed = True
    return HighLevelGraph(layers, graph.dependencies) if changed else graph


class StepDelayed(Delayed):
    """A step output as a Delayed (`dd.value_and_grad`'s loss and gradient leaves): as
    Dask's, with `optimize` as its optimization, so the outputs of a step computed together
    skip a hop through the scheduler and a transfer each."""

    __slots__ = ()

    __dask_optimize__ = staticmethod(optimize)

    #: no Dask expression: Dask asks every collection for one (`is_dask_collection`,
    #: ~4 times a leaf per compute), and a Delayed makes a new `DelayedAttr` for any
    #: attribute it lacks, tokenizing it (~1 ms a step of the tiny job's 9 leaves)
    expr = None


def needs_collection(tree: Any) -> bool:
    """True when `tree` (Delayed or None leaves) holds a pytree node that `dask.compute`
    does not walk into (a module, an `nnx.State`, a registered class)."""
    if isinstance(tree, Delayed) or tree is None:
        return False
    if type(tree) in (list, tuple):
        return any(map(needs_collection, tree))
    if type(tree) is dict:
        return any(map(needs_collection, tree.values()))
    return True


class DelayedTree(DaskMethodsMixin):
    """A pytree whose leaves are Delayed objects over one graph (None leaves stay None).

    ``dask.compute(tree)``, ``tree.compute()``, ``client.compute(tree)`` and ``persist``
    give back the same pytree type with concrete leaves. `tree.delayed` is the pytree
    with its Delayed leaves, to pick parts of it.
    """

    __slots__ = ("_leaves", "_skeleton")

    def __init__(self, tree: Any) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if not all(isinstance(x, Delayed) for x in leaves):
            bad = next(type(x).__name__ for x in leaves if not isinstance(x, Delayed))
            raise ArgumentError(f"DelayedTree needs Delayed leaves, got a {bad}")
        self._leaves: tuple[Delayed, ...] = tuple(leaves)
        # the pytree with each leaf's position: it pickles where a treedef may not
        self._skeleton = jax.tree_util.tree_unflatten(treedef,
                                                      [_Slot(i) for i in range(len(leaves))])

    @property
    def delayed(self) -> Any:
        """The pytree with its Delayed leaves."""
        return _refill(self._skeleton, self._leaves)

    def __dask_graph__(self) -> Any:
        if not self._leaves:
            return {}
        graphs = list({id(d.dask): d.dask for d in self._leaves}.values())
        return graphs[0] if len(graphs) == 1 else HighLevelGraph.merge(*graphs)

    def __dask_keys__(self) -> list[Any]:
        return [d.key for d in self._leaves]

    def __dask_layers__(self) -> Sequence[str]:
        return tuple(dict.fromkeys(n for d in self._leaves for n in d.__dask_layers__()))

    def __dask_tokenize__(self) -> Any:
        return ("dagdiff-tree", jax.tree_util.tree_structure(self._skeleton).__repr__(),
                tuple(d.key for d in self._leaves))

    __dask_scheduler__ = staticmethod(dask.threaded.get)

    __dask_optimize__ = staticmethod(optimize)   # the same as its leaves': one group

    def __dask_postcompute__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _finish, (self._skeleton,)

    def __dask_postpersist__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self._rebuild, ()

    def _rebuild(self, dsk: Any, *, rename: Any = None) -> "DelayedTree":
        post = [d.__dask_postpersist__() for d in self._leaves]
        leaves = [fn(dsk, *args, rename=rename) for fn, args in post]
        return DelayedTree(_refill(self._skeleton, leaves))

    def __repr__(self) -> str:
        kind = type(self._skeleton).__name__
        return f"DelayedTree({kind} with {len(self._leaves)} Delayed leaves)"


def _refill(skeleton: Any, values: Sequence[Any]) -> Any:
    """`skeleton` (a pytree of `_Slot` leaves) with each position replaced by its value."""
    vals = list(values)
    return jax.tree_util.tree_map(lambda s: vals[s.index], skeleton)


def _finish(results: Sequence[Any], skeleton: Any) -> Any:
    """Dask's post-compute step: the computed leaves put back in place."""
    return _refill(skeleton, results)


class _Slot:
    """A leaf position in `DelayedTree`'s skeleton (an object no pytree library converts,
    as NNX variables convert ints to arrays)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Slot, (self.index,))

    def __repr__(self) -> str:
        return f"<leaf {self.index}>"
