"""Assembling lowered tasks into one HighLevelGraph with placement annotations, and the
Delayed outputs a user gets."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from ..cluster.targets import Targets, annotations_for
from ..runtime.direct import RESOURCE_SHARE, DirectGraph, rewrite
from .collection import StepDelayed


__all__ = ["OutKey", "to_delayed", "submit", "assemble", "assemble_direct", "direct_layer",
           "pinned"]


class OutKey(str):
    """A task key that `to_delayed` should turn into a Delayed (other leaves pass through)."""


def to_delayed(graph: HighLevelGraph, keys: Any) -> Any:
    """Wrap the `OutKey` leaves of a pytree as Delayed objects sharing one graph
    (`StepDelayed`: computed together, each waits for its own worker's program alone)."""
    layers = list(graph.layers)

    def wrap(k: Any) -> Any:
        if not isinstance(k, OutKey):
            return k
        name = next((n for n in layers if k in graph.layers[n]), layers[0])
        return StepDelayed(str(k), graph, layer=name)

    return jax.tree_util.tree_map(wrap, keys, is_leaf=lambda x: x is None)


def submit(client: Any, graph: HighLevelGraph, keys: Sequence[Any]) -> list[Any]:
    """Futures of `keys` (key strings or `OutKey`s) of `graph`, computed on `client`: the
    graph, culled to them, goes to the scheduler as it is (`Client.get`), not through
    `client.compute`'s layer for collections (a Delayed per key, simplified and
    tokenized: ~1-2 ms of the client's CPU for a step's handful of keys here)."""
    names = [str(k) for k in keys]
    return client.get(graph.cull(set(names)), names, sync=False)


def assemble(dsk: dict[str, Any], stage_of: Mapping[str, int | None], targets: Targets,
             token: str, *, priority: Mapping[str, int] | None = None,
             direct: set[str] | None = None, outputs: set[str] = frozenset()
             ) -> HighLevelGraph:
    """One HighLevelGraph layer holding every task, with per-key placement annotations
    (and schedule priorities).

    `direct`: the step's output keys, to run it with direct dispatch (each worker's part
    becomes one program task, see `dagdiff.runtime.direct`); None keeps every edge a
    Dask dependency. `outputs` (direct dispatch): further outputs read straight from
    their worker's program (a Trainer's new parameters)."""
    priority = dict(priority or {})
    name = f"dagdiff-{token}"
    if direct is not None and targets.on_workers:
        return assemble_direct(dsk, stage_of, targets, token, priority=priority,
                               direct=direct, outputs=outputs)[0]
    annotations = annotations_for(stage_of, targets)
    if priority:
        annotations["priority"] = priority.get
    layer = MaterializedLayer(dsk, annotations=annotations or None)
    return HighLevelGraph({name: layer}, {name: set()})


def assemble_direct(dsk: dict[str, Any], stage_of: Mapping[str, int | None], targets: Targets,
                    token: str, *, priority: Mapping[str, int], direct: set[str],
                    outputs: set[str] = frozenset()
                    ) -> tuple[HighLevelGraph, DirectGraph, dict[str, int], dict[str, str]]:
    """`assemble` with direct dispatch, and its parts: the rewritten graph, each task's
    priority and worker (what a step template keeps)."""
    worker_of = {k: targets.target(s) for k, s in stage_of.items()}
    slots = targets.slots
    plan = rewrite(dsk, worker_of, priority, direct, targets.addresses, token,
                   slots=slots, outputs=set(outputs))
    where = {k: w for k, w in worker_of.items() if w is not None and k in plan.dsk}
    where.update(plan.placed)
    prio = {k: v for k, v in {**priority, **plan.priority}.items() if k in plan.dsk}
    return direct_layer(f"dagdiff-{token}", plan.dsk, prio, where, slots), plan, prio, where


def direct_layer(name: str, dsk: Mapping[str, Any], priority: Mapping[str, int],
                 where: Mapping[str, str], slots: bool) -> HighLevelGraph:
    """One HighLevelGraph layer of a direct-dispatch step: each task's priority and its
    worker (a share of its slot resource, or its address)."""
    annotations: dict[str, Any] = {"priority": dict(priority).get}
    if slots:   # shares: a program waiting for its inputs keeps its resources
        annotations["resources"] = {k: {w: RESOURCE_SHARE} for k, w in where.items()}.get
    else:
        annotations["workers"] = {k: [w] for k, w in where.items()}.get
    return HighLevelGraph({name: MaterializedLayer(dict(dsk), annotations=annotations)},
                          {name: set()})


def pinned(target: str, slots: bool) -> dict[str, Any]:
    """The `Client.submit` arguments that run a task on `target`: a share of its slot
    resource (a slot's worker may change; the share never blocks the slot's other
    tasks), or the worker at that address."""
    return {"resources": {target: RESOURCE_SHARE}} if slots else {"workers": [target]}
