"""Microbatched pipelines: split the batch, lower the traced model once per microbatch, and
make every worker run its tasks in the order its `Schedule` gives (ordering edges between
consecutive actions of a worker, plus priorities). Data dependencies still come only from
the traced graph; losses are averaged, gradients accumulated on the stage's worker."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

import jax

from ..core.backward import BackwardPlan
from ..core.dag import topological
from ..core.keys import make_key
from ..core.tracer import Trace, Traced
from ..errors import CycleError, PlacementError, ScheduleError
from ..runtime.tasks import (acc_task, mean_task, select_task, slice_task, snapshot,
                             sum_task)
from ..runtime.taskspec import DataNode, Task, TaskRef
from ..schedules import Schedule
from ..schedules.program import compile_schedule
from ..schedules.memory import back_to_back
from .lower import GradSum, Lowered, lower, select


__all__ = ["PipelineGraph", "lower_pipeline", "order_actions", "stage_workers",
           "fused_microbatches", "backward_order"]


@dataclass(frozen=True)
class PipelineGraph:
    """All microbatches' tasks (with their stages and schedule priorities), and the keys
    of the mean loss, each parameter's gradient and each microbatch's aux."""

    dsk: dict[str, Any]
    stage_of: dict[str, int | None]
    priority: dict[str, int]
    loss_key: str
    grad_keys: dict[int, str]
    aux_keys: list[Any]


def lower_pipeline(trace: Trace, plan: BackwardPlan, token: str, *, microbatches: int,
                   schedule: Schedule | None, batch: Mapping[int, Any], axis: int,
                   inputs: Mapping[int, Any], home: Mapping[int, int | None], loss: Traced,
                   aux: Any = None, devices: dict[int | None, int | None] | None = None,
                   stage_offset: int = 0) -> PipelineGraph:
    """Lower `trace` for `microbatches` microbatches, ordered per worker by `schedule`
    (None: no ordering beyond the data dependencies).

    `batch`: the full value of each microbatched input node, an array or a (key or
    Future, leaf) reference to data already in the graph / on the cluster; it is split
    on the worker of the input's first consumer. `inputs`: other input nodes' existing
    values (resident parameters). `home`: each input node's stage. The trace's stages
    start at `stage_offset` (a data-parallel replica's pipeline)."""
    m = microbatches
    dsk: dict[str, Any] = {}
    stage_of: dict[str, int | None] = {}
    shared: dict[int, tuple[Any, int]] = dict(inputs)
    splits: dict[int, list[str]] = {}
    for idx, value in batch.items():
        node = trace.nodes[idx]
        if isinstance(value, tuple):       # a reference: (key or Future, leaf)
            ref, src = value
            full_ref: Any = TaskRef(ref) if isinstance(ref, str) else ref
        else:
            full = make_key("input", node.path or "x", idx, token)
            dsk[full] = DataNode(full, snapshot(value))
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
    # the loss's backward inside its forward: where the schedule runs them back to back;
    # without a schedule only when there is one microbatch (nothing can run between)
    fused = fused_microbatches(trace, schedule, m, stage_offset) if schedule is not None \
        else set()
    fuse_all = schedule is None and m == 1
    # each stage's sums run in the order its backwards do (the schedule's), so a
    # microbatch's weight gradients are added as soon as they exist, not held until the
    # microbatches before it in number have theirs (looped-bfs runs them the other way)
    order = backward_order(trace, schedule, m, stage_offset) if schedule is not None else {}

    def acc_key(st: Any, mb: int) -> str:
        name = "grads" if st is None else f"grads_s{st}"
        return make_key("acc", name, 0 if st is None else st, token, st, mb)

    def acc_prev(st: Any, mb: int) -> str | None:
        seq = order.get(st) or list(range(m))
        i = seq.index(mb)
        return acc_key(st, seq[i - 1]) if i else None

    last_acc: dict[Any, str] = {}      # stage -> accumulator key of its last microbatch
    unused: dict[int, GradSum] = {}    # param node -> its (zero) gradient's record
    # param node -> {stage: position in that stage's accumulator}: a leaf used on several
    # stages (tied weights) is summed on each of them, then once across them
    acc_pos: dict[int, dict[Any, int]] = {}
    zeros_of: dict[int, Any] = {}      # param node -> (shape, dtype) of its gradient
    dev_of = (devices or {}).get
    for mb in range(m):
        mb_inputs = dict(shared)
        mb_inputs.update({idx: (keys[mb], -1) for idx, keys in splits.items()})
        low = lower(trace, plan, token, microbatch=mb, inputs=mb_inputs, seed_scale=1.0 / m,
                    split_backward=bool(schedule and schedule.split_backward),
                    devices=devices, accumulate=True,
                    fuse_seeded=fuse_all or {st for st, b in fused if b == mb})
        if mb == 0:  # params and other unsplit inputs: one data node for all microbatches
            for idx, key in low.data_keys.items():
                shared[idx] = (key, -1)
                stage_of[key] = home.get(idx)
        # gradient accumulation on the stage's worker: one task per (stage, microbatch)
        # sums the contributions to all of the stage's parameter leaves and adds the
        # previous microbatch's sums (one accumulator alive per stage, few small tasks)
        by_stage: dict[Any, list[tuple[int, list[tuple[int, Any]]]]] = defaultdict(list)
        for pnode, gs in low.grad_sums.items():
            zeros_of[pnode] = gs.zeros
            if not gs.srcs:     # a leaf the loss does not use: its gradient is zeros, once
                unused[pnode] = gs
                continue
            parts: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
            for src, v in zip(gs.srcs, gs.values):
                st = low.stage_of.get(v.key) if isinstance(v, TaskRef) else None
                parts[gs.stage if gs.stage is not None else st].append((src, v))
            for st, ps in parts.items():
                by_stage[st].append((pnode, ps))
        for st, entries_of in by_stage.items():
            layout, vals = [], []
            for pn, ps in entries_of:
                entries = []
                for src, v in ps:
                    vals.append(v)
                    entries.append((len(vals) - 1, src))
                layout.append((tuple(entries), zeros_of[pn]))
                acc_pos.setdefault(pn, {})[st] = len(layout) - 1
            k = acc_key(st, mb)
            prev = acc_prev(st, mb)
            low.add(k, Task(k, acc_task, tuple(layout), dev_of(st),
                            TaskRef(prev) if prev else None, *vals), st)
            seq = order.get(st) or list(range(m))
            last_acc[st] = acc_key(st, seq[-1])
        loss_keys.append(select(low, trace, loss, "loss", token, mb))
        aux_keys.append(jax.tree_util.tree_map(
            lambda v: select(low, trace, v, "aux", token, mb)
            if isinstance(v, Traced) else v, aux))
        dsk.update(low.dsk)
        stage_of.update(low.stage_of)
        lowered.append(low)
    grad_keys: dict[int, str] = {}
    for pn, pos in acc_pos.items():
        node = trace.nodes[pn]
        k = make_key("grad", node.path or node.name, pn, token)
        if len(pos) == 1:
            ((st, i),) = pos.items()
            dsk[k] = Task(k, select_task, i, TaskRef(last_acc[st]))
        else:
            # each stage's sum over the microbatches, added once on the leaf's own stage
            # (where its parameter lives and a Trainer updates it)
            st = home.get(pn)
            st = st if st in pos else next(iter(pos))
            dsk[k] = Task(k, sum_task, tuple(pos.values()), zeros_of[pn], dev_of(st),
                          *(TaskRef(last_acc[s]) for s in pos))
        stage_of[k] = st
        grad_keys[pn] = k
    for pn, gs in unused.items():
        # not a sum over microbatches (m chained tasks with no stage, outside the programs:
        # one Dask round trip each), but zeros made once on the leaf's stage, else the
        # loss's: an action of that stage's program
        node = trace.nodes[pn]
        k = make_key("grad", node.path or node.name, pn, token)
        st = home.get(pn)
        st = trace.nodes[loss.node].stage if st is None else st
        dsk[k] = Task(k, sum_task, (), gs.zeros, dev_of(st))
        stage_of[k] = st
        grad_keys[pn] = k
    lnode = trace.nodes[loss.node]
    loss_key = make_key("loss", lnode.name, lnode.index, token)
    means = [TaskRef(k) for k in loss_keys]
    if lnode.stage is not None:
        # the mean on the loss's stage, then the output picks it: with direct dispatch the
        # mean is an action of that stage's program, and one small task (not m + 1)
        # runs after the programs to hand the loss over
        mean_key = make_key("loss", lnode.name, lnode.index, token, lnode.stage)
        dsk[mean_key] = Task(mean_key, mean_task, *means)
        stage_of[mean_key] = lnode.stage
        dsk[loss_key] = Task(loss_key, select_task, -1, TaskRef(mean_key))
    else:
        dsk[loss_key] = Task(loss_key, mean_task, *means)
    stage_of[loss_key] = lnode.stage
    priority = (order_actions(dsk, lowered, trace, schedule, m, stage_offset)
                if schedule is not None else {})
    return PipelineGraph(dsk, stage_of, priority, loss_key, grad_keys, aux_keys)


def backward_order(trace: Trace, schedule: Schedule, m: int, stage_offset: int = 0
                   ) -> dict[int, list[int]]:
    """Per global stage: its microbatches in the order the schedule runs their weight
    gradients (B, or W with a split backward); {} when the schedule cannot run the model
    (`order_actions` says why)."""
    stages = {n.stage for n in trace.nodes if n.kind == "call"}
    if None in stages or not stages:
        return {}
    v = schedule.virtual_stages
    n_stages = max(stages) + 1 - stage_offset     # type: ignore[operator]
    if n_stages % v:
        return {}
    try:
        program = compile_schedule(schedule, n_stages // v, m)
    except Exception:       # noqa: BLE001 - order_actions raises the error
        return {}
    kind = "W" if schedule.split_backward else "B"
    out: dict[int, list[int]] = {}
    for acts in program.workers:
        for act in acts:
            if act.kind == kind:
                out.setdefault(stage_offset + act.stage, []).append(act.microbatch)
    return {g: seq for g, seq in out.items() if sorted(seq) == list(range(m))}


def fused_microbatches(trace: Trace, schedule: Schedule, m: int,
                       stage_offset: int = 0) -> set[tuple[int | None, int]]:
    """The (stage, microbatch) pairs whose backward `schedule` runs right after their
    forward on the stage's worker (F then B; with a split backward F then I, W at any
    later time): there the loss's call can compute its forward and backward (with a
    split backward: its I part) as one (`lower`'s ``fuse_seeded``). Empty when the
    schedule cannot run the model (`order_actions` says why)."""
    stages = {n.stage for n in trace.nodes if n.kind == "call"}
    if None in stages or not stages:
        return set()
    v = schedule.virtual_stages
    n_stages = max(stages) + 1 - stage_offset     # type: ignore[operator]
    if n_stages % v:
        return set()
    p = n_stages // v
    try:
        pairs = back_to_back(schedule, p, m)
    except Exception:       # noqa: BLE001 - a schedule that cannot run: order_actions says why
        return set()
    return {(stage_offset + g, mb) for g, mb in pairs}


def stage_workers(schedule: Schedule, n_stages: int, replicas: int = 1) -> dict[int, int]:
    """The worker slot (index) of each stage under `schedule`'s layout: replica r's stages
    ``r * n_stages ...`` run on slots ``r * p ...`` (p workers per replica). Stages
    that do not fill the layout (a model with fewer stages than p * v) keep slot = stage."""
    v = schedule.virtual_stages
    if n_stages % v:
        return {}
    p = n_stages // v
    layout = schedule.checked_layout(p)
    return {r * n_stages + s: r * p + w for r in range(replicas)
            for w, chunks in enumerate(layout) for s in chunks}


def order_actions(dsk: dict[str, Any], lowered: list[Lowered], trace: Trace,
                  schedule: Schedule, m: int, stage_offset: int = 0) -> dict[str, int]:
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
            "stages='auto' (a layer or an operator on traced values, such as + * / @, "
            "outside any `dd.stage` block runs on its inputs' stage when they all come from "
            "one stage; one that reads several stages, or none, needs a stage of its own)."
            + (f" microbatches={m} makes the step a pipeline (schedule {schedule.name!r} "
               "unless you give one); to accumulate gradients over microbatches with the "
               "whole model on one worker, pass stages=1" if stages == [None] else ""))
    v = schedule.virtual_stages
    n_stages = max(stages) + 1 - stage_offset
    if n_stages % v:
        raise PlacementError(
            f"schedule {schedule.name!r} with {v} virtual stages per worker needs a number of "
            f"stages divisible by {v}; the model has {n_stages}")
    p = n_stages // v
    # the schedule compiled once (checked, runnable, each action's global stage): the
    # order every dispatch mode follows
    program = compile_schedule(schedule, p, m)
    # the tasks of each action (stage, microbatch, phase), from the lowering's own records
    tasks: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    label: dict[str, str] = {}
    for mb, low in enumerate(lowered):
        for node, key in low.fwd_keys.items():
            n = trace.nodes[node]
            tasks[(n.stage, mb, "F")].append(key)
            label[key] = f"F{mb} of {n.name!r} (stage {n.stage})"
        for node, phased in low.bwd_keys.items():
            n = trace.nodes[node]
            for phase, key in phased:
                tasks[(n.stage, mb, phase)].append(key)
                label[key] = f"{phase}{mb} of {n.name!r} (stage {n.stage})"
    priority: dict[str, int] = {}
    for acts in program.workers:
        prev_exit: list[str] = []
        for pos, act in enumerate(acts):
            keys = tasks.get((stage_offset + act.stage, act.microbatch, act.kind), [])
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
    _check_acyclic(dsk, trace, schedule, label)
    return priority


def _check_acyclic(dsk: Mapping[str, Any], trace: Trace, schedule: Schedule,
                   label: Mapping[str, str]) -> None:
    """Raise ScheduleError when the schedule's ordering edges close a cycle with the data
    edges (e.g. a model that comes back to an earlier stage: under 1F1B that stage's
    backward would have to wait for a forward that waits for it)."""
    try:
        topological({k: getattr(t, "dependencies", ()) for k, t in dsk.items()})
        return
    except CycleError as e:
        stuck = set(e.stuck)
    cycle = _a_cycle(dsk, stuck)
    steps = " -> ".join(label.get(k, k) for k in cycle[:8]) + (" ..." if len(cycle) > 8 else "")
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
