"""Microbatched pipelines: split the batch, lower the traced model once per microbatch, and
make every worker run its tasks in the order its `Schedule` gives (ordering edges between
consecutive actions of a worker, plus priorities). Data dependencies still come only from
the traced graph; losses are averaged, gradients accumulated on the stage's worker."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from .taskspec import DataNode, Task, TaskRef

from .errors import MicrobatchError, PlacementError
from .keys import key_info, make_key
from .lower import Lowered
from .dag import CycleError, topological
from .schedules import Schedule, ScheduleError, get_schedule, simulate
from .tasks import acc_task, mean_task, select_task, slice_task

__all__ = ["microbatch_avals", "lower_pipeline", "PipelineGraph", "order_actions"]


def microbatch_avals(args: Sequence[Any], names: Sequence[str], batch_argnums: Sequence[int],
                     axis: int, m: int) -> list[Any]:
    """The arguments with each batch leaf replaced by its microbatch's ShapeDtypeStruct."""
    out = list(args)
    for i in batch_argnums:
        def shrink(x: Any, i: int = i) -> Any:
            if not isinstance(x, (jax.Array, np.ndarray)):
                return x
            shape = tuple(np.shape(x))
            if not shape:
                raise MicrobatchError(f"argument {names[i]!r} has a scalar leaf; it cannot be "
                                      f"split into {m} microbatches (exclude it with "
                                      "batch_argnums=...)")
            if not -len(shape) <= axis < len(shape):
                raise MicrobatchError(
                    f"batch_axis={axis} but argument {names[i]!r} has shape {shape} "
                    f"({len(shape)} axes); give an axis in {-len(shape)}..{len(shape) - 1}, or "
                    "leave the argument out of batch_argnums")
            ax = axis % len(shape)
            if shape[ax] % m:
                raise MicrobatchError(
                    f"argument {names[i]!r} has shape {shape}: its axis {ax} (size "
                    f"{shape[ax]}) does not divide into {m} microbatches; use a batch size "
                    f"that is a multiple of {m}, or another microbatches=")
            new = list(shape)
            new[ax] //= m
            return jax.ShapeDtypeStruct(tuple(new), x.dtype)
        out[i] = jax.tree_util.tree_map(shrink, args[i])
    return out


@dataclasses.dataclass
class PipelineGraph:
    """All microbatches' tasks, with the keys of the mean loss, grads and per-mb aux."""

    dsk: dict[str, Any]
    stage_of: dict[str, int | None]
    priority: dict[str, int]
    loss_key: str
    grad_keys: dict[int, str]
    aux_keys: list[Any]
    lowered: list[Lowered]


def lower_pipeline(trace: Any, plan: Any, token: str, m: int, schedule: Schedule | None,
                   full_values: Mapping[int, Any], axis: int, resident: Mapping[int, Any],
                   home: Mapping[int, int | None], loss: Any, aux: Any,
                   devices: dict[int | None, int | None] | None,
                   stage_offset: int = 0) -> PipelineGraph:
    """Lower `trace` for `m` microbatches, ordered per worker by `schedule` (None: no
    ordering beyond the data dependencies). `full_values` values may be arrays or
    (key or Future, leaf) references to data already in the graph / on the cluster."""
    from .lower import lower, select

    dsk: dict[str, Any] = {}
    stage_of: dict[str, int | None] = {}
    shared: dict[int, tuple[Any, int]] = dict(resident)
    # full batch values once, split on the worker of the input's first consumer
    splits: dict[int, list[str]] = {}
    for idx, value in full_values.items():
        node = trace.nodes[idx]
        if isinstance(value, tuple):       # a reference: (key or Future, leaf)
            ref, src = value
            full_ref: Any = TaskRef(ref) if isinstance(ref, str) else ref
        else:
            full = make_key("input", node.path or "x", idx, token)
            dsk[full] = DataNode(full, value)
            stage_of[full] = home.get(idx)
            full_ref, src = TaskRef(full), -1
        splits[idx] = []
        for mb in range(m):
            k = make_key("split", node.path or "x", idx, token, None, mb)
            dsk[k] = Task(k, slice_task, axis, mb, m, full_ref, src)
            stage_of[k] = home.get(idx)
            splits[idx].append(k)
    lowered: list[Lowered] = []
    loss_keys, aux_keys = [], []
    prev_acc: dict[Any, str] = {}      # stage -> accumulator key of the latest microbatch
    acc_pos: dict[int, int] = {}       # param node -> position in its stage's accumulator
    acc_of: dict[int, Any] = {}        # param node -> stage of its accumulator
    for mb in range(m):
        inputs = dict(shared)
        inputs.update({idx: (keys[mb], -1) for idx, keys in splits.items()})
        low = lower(trace, plan, token, microbatch=mb, inputs=inputs, seed_scale=1.0 / m,
                    split_backward=bool(schedule and schedule.split_backward), devices=devices)
        if mb == 0:  # params and other unsplit inputs: one data node for all microbatches
            for idx, key in low.data_keys.items():
                shared[idx] = (key, -1)
                stage_of[key] = home.get(idx)
        # gradient accumulation on the stage's worker: one task per (stage, microbatch)
        # sums the contributions to all of the stage's parameter leaves and adds the
        # previous microbatch's sums (one accumulator alive per stage, few small tasks)
        by_stage: dict[Any, list[int]] = defaultdict(list)
        for pnode, key in low.grad_keys.items():
            by_stage[low.stage_of.get(key)].append(pnode)
        for st, pnodes in by_stage.items():
            layout, vals = [], []
            dev = None
            for pn in pnodes:
                key = low.grad_keys[pn]
                srcs, zeros, dev, *parts = low.dsk.pop(key).args
                low.stage_of.pop(key, None)
                entries = []
                for src, v in zip(srcs, parts):
                    vals.append(v)
                    entries.append((len(vals) - 1, src))
                layout.append((tuple(entries), zeros))
                acc_pos[pn] = len(layout) - 1
            name = "grads" if st is None else f"grads_s{st}"
            k = make_key("acc", name, 0 if st is None else st, token, st, mb)
            prev = prev_acc.get(st)
            low.dsk[k] = Task(k, acc_task, tuple(layout), dev,
                              TaskRef(prev) if prev else None, *vals)
            low.stage_of[k] = st
            prev_acc[st] = k
            for pn in pnodes:
                acc_of[pn] = st
        loss_keys.append(select(low, trace, loss, "loss", token, mb))
        aux_keys.append(jax.tree_util.tree_map(
            lambda v: select(low, trace, v, "aux", token, mb)
            if hasattr(v, "trace") else v, aux))
        dsk.update(low.dsk)
        stage_of.update(low.stage_of)
        lowered.append(low)
    grad_keys: dict[int, str] = {}
    for pn, st in acc_of.items():
        node = trace.nodes[pn]
        k = make_key("grad", node.path or node.name, pn, token)
        dsk[k] = Task(k, select_task, acc_pos[pn], TaskRef(prev_acc[st]))
        stage_of[k] = st
        grad_keys[pn] = k
    lnode = trace.nodes[loss.node]
    loss_key = make_key("loss", lnode.name, lnode.index, token)
    dsk[loss_key] = Task(loss_key, mean_task, *[TaskRef(k) for k in loss_keys])
    stage_of[loss_key] = lnode.stage
    priority = (order_actions(dsk, lowered, trace, schedule, m, stage_offset)
                if schedule is not None else {})
    return PipelineGraph(dsk, stage_of, priority, loss_key, grad_keys, aux_keys, lowered)


def order_actions(dsk: dict[str, Any], lowered: list[Lowered], trace: Any, schedule: Schedule,
                  m: int, stage_offset: int = 0) -> dict[str, int]:
    """Add ordering edges so each worker runs its schedule's actions in order; return
    per-key priorities (earlier action = higher priority). Stages of the trace start at
    `stage_offset` (a data-parallel replica's pipeline)."""
    stages = sorted({n.stage for n in trace.nodes if n.kind == "call"},
                    key=lambda s: -1 if s is None else s)
    if None in stages:
        unstaged = sorted({n.name for n in trace.nodes if n.kind == "call" and n.stage is None})
        raise PlacementError(
            f"a pipeline schedule needs every layer on a stage; unstaged layers: "
            f"{', '.join(unstaged)}. Use @dd.layer(stage=k), `with dd.stage(k):`, or "
            "stages='auto'.")
    v = schedule.virtual_stages
    n_stages = max(stages) + 1 - stage_offset
    if n_stages % v:
        raise PlacementError(
            f"schedule {schedule.name!r} with {v} virtual stages per worker needs a number of "
            f"stages divisible by {v}; the model has {n_stages}")
    p = n_stages // v
    simulate(schedule, p, m)                 # a custom schedule that cannot run fails here
    tasks: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    for low in lowered:
        for key in list(low.fwd_keys.values()) + [k for ks in low.bwd_keys.values() for k in ks]:
            info = key_info(key)
            tasks[(info.stage, info.microbatch, info.phase)].append(key)
    priority: dict[str, int] = {}
    for w, acts in enumerate(schedule.actions(p, m)):
        prev_exit: list[str] = []
        for pos, text in enumerate(acts):
            kind, rest = text[0], text[1:]
            mb_s, _, chunk_s = rest.partition(".")
            stage = stage_offset + int(chunk_s or 0) * p + w
            keys = tasks.get((stage, int(mb_s), kind), [])
            if not keys:
                continue
            inside = set(keys)
            entry = [k for k in keys if not (dsk[k].dependencies & inside)]
            needed = {d for k in keys for d in dsk[k].dependencies}
            exits = [k for k in keys if k not in needed]
            # Each action waits for the previous action of its worker. Looser rules (only
            # at forward/backward switches, priorities elsewhere) save round trips but let
            # transfers that finish out of order reorder a worker's actions; measured here.
            for k in entry:
                t = dsk[k]
                extra = {f"after_{i}": TaskRef(e) for i, e in enumerate(prev_exit)
                         if e not in t.dependencies}
                if extra:
                    dsk[k] = Task(k, t.func, *t.args, **t.kwargs, **extra)
            for k in keys:
                priority[k] = len(acts) - pos
            prev_exit = exits
    _check_acyclic(dsk, trace, schedule)
    return priority


def _check_acyclic(dsk: Mapping[str, Any], trace: Any, schedule: Schedule) -> None:
    """Raise ScheduleError when the schedule's ordering edges close a cycle with the data
    edges (e.g. a model that comes back to an earlier stage: under 1F1B that stage's
    backward would have to wait for a forward that waits for it)."""
    try:
        topological({k: getattr(t, "dependencies", ()) for k, t in dsk.items()})
        return
    except CycleError as e:
        stuck = set(e.stuck)
    cycle = _a_cycle(dsk, stuck)
    steps = " -> ".join(_describe_key(k) for k in cycle[:8]) + (" ..." if len(cycle) > 8 else "")
    back = [f"{n.name!r} on stage {n.stage} reads {trace.nodes[x.node].name!r} on stage "
            f"{trace.nodes[x.node].stage}"
            for n in trace.nodes if n.kind == "call"
            for x in n.in_leaves if getattr(x, "node", None) is not None
            and trace.nodes[x.node].kind == "call"
            and (trace.nodes[x.node].stage or 0) > (n.stage or 0)]
    hint = (f"the model goes back to an earlier stage ({back[0]}); number stages in model "
            "order (a worker may hold several: schedule='interleaved' with stages 0..p*v-1), "
            "or use schedule='gpipe'" if back else
            "check that each worker's order runs a microbatch's forward before its backward")
    raise ScheduleError(
        f"schedule {schedule.name!r} cannot run this model: with its order on the workers, "
        f"tasks wait for each other in a circle (each waits for the next: {steps}); "
        f"fix: {hint}")


def _a_cycle(dsk: Mapping[str, Any], stuck: set[str]) -> list[str]:
    """One cycle among `stuck` keys (each has a dependency among them)."""
    k = min(stuck)
    seen: dict[str, int] = {}
    path: list[str] = []
    while k not in seen:
        seen[k] = len(path)
        path.append(k)
        k = min(d for d in dsk[k].dependencies if d in stuck)
    return path[seen[k]:] + [k]


def _describe_key(key: str) -> str:
    try:
        info = key_info(key)
    except Exception:
        return key
    return f"{info.phase}{info.microbatch} of {info.layer!r} (stage {info.stage})"


def resolve_schedule(schedule: Any) -> Schedule:
    return get_schedule(schedule if schedule is not None else "1f1b")
