"""A pipelined step's lowering, shared by `build` and `dd.Trainer`: the model lowered per
replica, what a caller adds on top (the Trainer's all-reduce, updates and mean loss),
the assembly into one graph, and the template the step is bound to or kept as.

`dd.value_and_grad` lowers one replica and adds nothing; the Trainer lowers one per
data-parallel copy and extends the tasks. Both go through `compile_step`, so the
template cache (compile once, run many: `dagdiff.lowering.template`) serves both, and a
change to lowering, assembly or templates is made once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import dask
from dask.highlevelgraph import HighLevelGraph

from ..cluster.targets import Targets
from ..core.tracer import Trace
from ..lowering import template as templates
from ..lowering.graph import assemble, assemble_direct, direct_layer
from ..lowering.memory import check_memory
from ..lowering.pipeline import PipelineGraph, lower_pipeline
from ..runtime.direct.graph import (Source, WindowError, chain_step, group_outputs,
                                    merge_window, push_output)
from ..runtime.direct.inbox import pushes_enabled
from ..runtime.direct.runtime import new_nonce
from .options import Options


__all__ = ["StepTasks", "Binding", "lower_replicas", "compile_step", "replace_stages",
           "chain_steps", "Source", "window_graph", "WindowError", "gather_graph",
           "push_loss"]


@dataclass(frozen=True)
class StepTasks:
    """A lowered step before assembly: its tasks, their stages and priorities, the pytree
    of output keys (`OutKey` leaves), the outputs the client reads (`direct`: with direct
    dispatch each is computed by a small task reading its worker's program) and the
    further outputs read straight from their program (`outputs`: a Trainer's new
    parameters, which the next step's program on that worker reads in place)."""

    dsk: dict[str, Any]
    stage_of: dict[str, int | None]
    priority: dict[str, int]
    keys: Any
    direct: frozenset[str]
    outputs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Binding:
    """What binds a step to its template: the template's key (everything the lowering
    depends on besides what is bound), and the bound parts of this step. Slots are the
    caller's names for bound values (a batch node; a (replica, node) pair; a parameter
    group)."""

    key: str
    #: slot -> the value bound there (a batch array, or a replica's shard of it)
    values: Mapping[Hashable, Any]
    #: slot -> the Future bound there (resident parameters, a Trainer's state)
    refs: Mapping[Hashable, Any]
    #: capture: the key of each data node holding a bound value -> its slot
    inputs: Mapping[str, Hashable]
    #: capture: the key of each bound Future -> its slot
    held: Mapping[str, Hashable]
    #: bind: template keys renamed otherwise than by token, from the template's output
    #: keys (e.g. a key that names the step's number)
    rename: Callable[[Any], Mapping[str, str]] | None = None


def replace_stages(trace: Trace, offset: int) -> Trace:
    """`trace` with every stage moved up by `offset` (a data-parallel replica's stages)."""
    if offset == 0:
        return trace
    new = Trace(trace.name)
    new.nodes = [dataclasses.replace(n, stage=n.stage + offset)
                 if n.kind == "call" and n.stage is not None else n for n in trace.nodes]
    new.closed = True
    return new


def lower_replicas(model: Any, options: Options, targets: Targets, client: Any,
                   tokens: Sequence[str], *, p: int,
                   batch: Callable[[int], Mapping[int, Any]],
                   inputs: Callable[[int], Mapping[int, Any]],
                   home: Mapping[int, int | None], aux: Any = None,
                   devices: Mapping[int | None, int | None] | None = None,
                   held: Mapping[int, float] | None = None,
                   ) -> tuple[dict[str, Any], dict[str, int | None], dict[str, int],
                              list[PipelineGraph]]:
    """Replica r (`tokens[r]`) of the pipelined `model` on stages ``r*p ... r*p + p-1``,
    reading `batch(r)` (node -> its full value for this replica) and `inputs(r)` (node ->
    a resident (Future, leaf)); every replica's tasks in one dict. A step that cannot fit
    a worker's memory limit is refused first (`MemoryLimitError`; `held[g]`: what stage
    g holds beside the step, e.g. a Trainer's optimizer state)."""
    trace = model.trace
    if client is not None and options.schedule is not None and targets.on_workers:
        lstage = trace.nodes[model.loss.node].stage
        for r in range(len(tokens)):
            check_memory(trace, options.schedule, options.microbatches, options.remat,
                         lstage, {g: targets.address(g + r * p) for g in range(p)}, client,
                         held)
    dsk: dict[str, Any] = {}
    stage_of: dict[str, int | None] = {}
    priority: dict[str, int] = {}
    parts = []
    for r, token in enumerate(tokens):
        shift = r * p
        pg = lower_pipeline(replace_stages(trace, shift), model.plan, token,
                            microbatches=options.microbatches, schedule=options.schedule,
                            batch=batch(r), axis=options.batch_axis, inputs=inputs(r),
                            home={k: (v + shift if v is not None else None)
                                  for k, v in home.items()},
                            loss=model.loss, aux=aux if r == 0 else None,
                            devices=dict(devices) if devices is not None else None,
                            stage_offset=shift)
        dsk.update(pg.dsk)
        stage_of.update(pg.stage_of)
        priority.update(pg.priority)
        parts.append(pg)
    return dsk, stage_of, priority, parts


def compile_step(token: str, targets: Targets, direct: bool, binding: Binding | None,
                 lower: Callable[[], StepTasks]) -> tuple[HighLevelGraph, Any]:
    """The step's graph and output keys: bound to the template under `binding.key` when
    there is one, else `lower()`-ed, assembled (into per-worker programs with `direct`
    dispatch) and, with a binding, kept as that template."""
    if binding is not None:
        tpl = templates.lookup(binding.key)
        if tpl is not None:
            renamed = binding.rename(tpl.keys) if binding.rename is not None else None
            return tpl.bind(token, binding.values, binding.refs, renamed)
    tasks = lower()
    if not direct or not targets.on_workers:
        graph = assemble(tasks.dsk, tasks.stage_of, targets, token, priority=tasks.priority,
                         direct=set(tasks.direct) if direct else None,
                         outputs=set(tasks.outputs))
        return graph, tasks.keys
    graph, plan, prio, where = assemble_direct(
        tasks.dsk, tasks.stage_of, targets, token, priority=tasks.priority,
        direct=set(tasks.direct), outputs=set(tasks.outputs))
    if binding is not None:
        tpl = templates.StepTemplate.capture(token, "dagdiff", plan, prio, where,
                                             targets.slots, binding.inputs, binding.held,
                                             tasks.keys)
        if tpl is not None:
            templates.store(binding.key, tpl)
    return graph, tasks.keys


def chain_steps(graph: HighLevelGraph, sources: Mapping[str, Source], keys: Sequence[str]
                ) -> dict[str, Source]:
    """A direct-dispatch step's graph (one layer, about to be submitted) with each program
    reading the values of `sources` its worker's earlier program made straight from that
    program (`dagdiff.runtime.direct.graph.chain_step`); the sources of this step's `keys`
    for the next step. Dask config ``dagdiff.direct.chain-steps: false``: unchanged, {}."""
    if not dask.config.get("dagdiff.direct.chain-steps", True):
        return {}
    return chain_step(graph.layers[next(iter(graph.layers))].mapping, sources, keys)


def push_loss(graph: HighLevelGraph, key: str) -> bool:
    """Make output `key` of a direct-dispatch step's graph (a Trainer step's loss, one
    layer, about to be submitted; changed in place) push its value to the client inboxes
    open on its worker as it ends (`runtime.direct.inbox`), unless dask config
    ``dagdiff.direct.push-outputs`` is false. Every submission of a step marks it alike,
    whichever client submits it (one key, one task). False: not such an output."""
    if not pushes_enabled() or len(graph.layers) != 1:
        return False
    return push_output(graph.layers[next(iter(graph.layers))].mapping, key)


def window_graph(graphs: Sequence[HighLevelGraph], loss_keys: Sequence[str],
                 state_keys: Sequence[Sequence[str]]
                 ) -> tuple[HighLevelGraph, dict[str, str]]:
    """k chained direct-dispatch steps' graphs (`chain_steps` each, in order) as one
    graph to submit at once: per worker one task for its k programs, one nonce, the k
    losses as one output, the last step's state
    (`dagdiff.runtime.direct.graph.merge_window`). Returns the graph and the keys the
    window gives its outputs: last step's key (its loss, each state value) -> the
    window's. Raises `WindowError` for steps that cannot share a window (submit them one
    by one)."""
    layers = [g.layers[next(iter(g.layers))] for g in graphs]
    dsks = [dict(layer.mapping) for layer in layers]
    new, takes = merge_window(dsks, list(loss_keys), [list(k) for k in state_keys])
    outs = {loss_keys[-1], *state_keys[-1]}
    renamed = {old: key for key, old in takes.items() if old in outs}
    return _relayer(f"dagdiff-window-{str(loss_keys[-1]).rsplit('-', 1)[-1]}", new, takes,
                    layers), renamed


def gather_graph(graph: HighLevelGraph, keys: Sequence[str], inbox: str = ""
                 ) -> tuple[HighLevelGraph, dict[str, tuple[str, int | None]]]:
    """A direct-dispatch step's graph for a caller that gathers the outputs `keys` at
    once (`step.compute`): each worker's outputs as one task returning them as a tuple
    (`dagdiff.runtime.direct.graph.group_outputs`). Returns the graph and, per key of
    `keys`, (the key to compute, its index in that task's tuple, or None: the value
    itself). A graph that is not one direct-dispatch layer comes back as it is. Each call
    makes a graph of its own: where each worker's program hands back its outputs itself,
    the programs run under a fresh nonce that their keys end with (no nonce task), and
    with `inbox` (a client inbox's id) push their outputs to it as they end."""
    plain: dict[str, tuple[str, int | None]] = {k: (k, None) for k in keys}
    if len(graph.layers) != 1:
        return graph, plain
    (name, layer), = graph.layers.items()
    dsk = dict(layer.mapping)
    new, takes, where, fused = group_outputs(dsk, keys, nonce=new_nonce(), inbox=inbox)
    if not new:
        return graph, plain
    for key in [*where, *fused]:
        del dsk[key]
    dsk.update(new)
    takes = {**{k: k for k in dsk if k not in new}, **takes}
    return _relayer(f"{name}-gathered", dsk, takes, [layer]), {**plain, **where}


def _relayer(name: str, dsk: Mapping[str, Any], takes: Mapping[str, str],
             layers: Sequence[Any]) -> HighLevelGraph:
    """`dsk` as one direct-dispatch layer, each task placed and ranked as the task of
    `layers` that `takes` names for it (tasks it does not name: unplaced)."""
    priority: dict[str, int] = {}
    where: dict[str, str] = {}
    slots = "resources" in layers[0].annotations
    for key, old in takes.items():
        layer = next(layer for layer in layers if old in layer.mapping)
        p = layer.annotations["priority"](old)
        if p is not None:
            priority[key] = p
        spot = layer.annotations["resources" if slots else "workers"](old)
        if spot:
            where[key] = next(iter(spot))
    return direct_layer(name, dsk, priority, where, slots)
