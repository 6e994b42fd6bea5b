"""Lowering: a traced forward graph + its backward plan -> a Dask task graph.

Each call node becomes one forward task (``fwd_<layer>``), each `Vjp` one VJP task
(``vjp_<layer>``, or ``igrad_``/``wgrad_`` when split), each `Sum` an ``add_``/``grad_``
task; inputs become data nodes. Data dependencies come only from the traced graph.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import dask
import jax
import numpy as np
from dask.base import tokenize

from ..core.backward import SEED, BackwardPlan, Source, Sum, Vjp
from ..core.keys import make_key
from ..core.tracer import Node, Trace, Traced
from ..runtime.tasks import fwd_task, select_task, snapshot, sum_task, vjp_task
from ..runtime.taskspec import DataNode, Task, TaskRef


__all__ = ["Lowered", "GradSum", "lower", "select", "trace_token"]


@dataclass(frozen=True)
class GradSum:
    """The gradient of one parameter leaf, not yet emitted as a task: its contributions
    (`values`, each a TaskRef or constant, with the leaf `srcs` to take of it), the
    (shape, dtype) of zeros when there are none, its stage and local device."""

    srcs: tuple[int, ...]
    values: tuple[Any, ...]
    zeros: tuple[tuple[int, ...], Any]
    stage: int | None
    device: int | None


@dataclass
class Lowered:
    """The tasks of one lowered trace (one microbatch), and where its results are."""

    dsk: dict[str, Any] = field(default_factory=dict)
    stage_of: dict[str, int | None] = field(default_factory=dict)   # key -> stage
    fwd_keys: dict[int, str] = field(default_factory=dict)          # call node -> key
    bwd_keys: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # node -> (phase, key)
    grad_keys: dict[int, str] = field(default_factory=dict)         # param node -> key
    grad_sums: dict[int, GradSum] = field(default_factory=dict)     # param node -> (accumulate)
    data_keys: dict[int, str] = field(default_factory=dict)         # input node -> key
    op_keys: dict[int, str] = field(default_factory=dict)           # backward op -> key

    def add(self, key: str, task: Any, stage: int | None) -> str:
        self.dsk[key] = task
        self.stage_of[key] = stage
        return key


#: per closed trace, per bound set: the digest of its structure and input values (a
#: Trainer traces once per batch signature and tokenizes that trace every step)
_digests: "weakref.WeakKeyDictionary[Trace, dict[Any, bytes]]" = weakref.WeakKeyDictionary()


def trace_token(trace: Trace, extra: Any = None, bound: Mapping[int, Any] | None = None
                ) -> str:
    """A deterministic token for a trace: its structure and its input values.

    The structure is hashed as one string (fast for 10,000-call graphs); only input
    values and array constants go through `dask.base.tokenize` (cached per jax array).
    `bound`: input nodes whose value is left out (only their avals and the value of the
    mapping count), as a step template binds them. A closed trace's digest is kept (per
    `bound`) while the trace lives: only `extra` is hashed again."""
    bound = bound or {}
    key = tuple(sorted((n, repr(v)) for n, v in bound.items()))
    kept = _digests.get(trace) if trace.closed else None
    digest = None if kept is None else kept.get(key)
    if digest is None:
        digest = _structure_digest(trace, bound)
        if trace.closed:
            _digests.setdefault(trace, {})[key] = digest
    h = hashlib.blake2b(digest, digest_size=16)
    h.update(f"{trace.name}\n{extra!r}".encode())
    return h.hexdigest()[:16]


def _structure_digest(trace: Trace, bound: Mapping[int, Any]) -> bytes:
    """The digest of `trace`'s nodes and of the values of its unbound inputs."""
    lines: list[str] = []
    values: list[Any] = []
    for n in trace.nodes:
        if n.kind == "call":
            refs = ",".join(f"{x.node}.{x.leaf}" if isinstance(x, Traced) else "c"
                            for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d")
            lines.append(f"{n.spec.fingerprint}|{n.stage}|{refs}")
            values.extend(x for x, k in zip(n.in_leaves, n.spec.kinds)
                          if k == "d" and not isinstance(x, Traced))
        elif n.index in bound:
            lines.append(f"{n.kind}|{n.path}|bound|{n.out_avals}|{bound[n.index]!r}")
        else:
            lines.append(f"{n.kind}|{n.path}")
            values.append(n.value)
    h = hashlib.blake2b("\n".join(lines).encode(), digest_size=16)
    h.update(tokenize(*map(_plain, values), ensure_deterministic=False).encode())
    return h.digest()


def _plain(value: Any) -> Any:
    """An abstract input (`jax.ShapeDtypeStruct`: a traced step's parameters that live on
    the workers) as a tuple: `tokenize` would pickle it (~50 us each, a dozen per step)."""
    if isinstance(value, jax.ShapeDtypeStruct) and value.sharding is None:
        return ("ShapeDtypeStruct", value.shape, value.dtype.name, value.weak_type)
    return value


def lower(
    trace: Trace,
    plan: BackwardPlan | None,
    token: str,
    *,
    microbatch: int | None = None,
    inputs: dict[int, tuple[str, int]] | None = None,
    seed_scale: float = 1.0,
    split_backward: bool = False,
    devices: dict[int | None, int | None] | None = None,
    accumulate: bool = False,
    fuse_seeded: bool | Collection[int | None] = False,
) -> Lowered:
    """Emit the tasks of `trace` (and of `plan`, when given) into a `Lowered`.

    `inputs` maps input nodes to already existing keys (key, leaf) - e.g. microbatch
    splits; other input and param nodes become data nodes. `seed_scale` is the
    cotangent of the loss (1/m when m microbatch losses are averaged).
    `split_backward` emits separate input-gradient (I) and weight-gradient (W) tasks.
    `devices` maps stages to local JAX device indices (single-process stage pinning).
    `accumulate`: leave the parameter gradients as `GradSum` records in `grad_sums` for
    the caller to sum (a pipeline sums them over microbatches), instead of tasks.
    `fuse_seeded`: on these stages (True: all), a call whose output cotangents are all
    the loss's seed (the call that computes the loss) computes its backward together
    with its forward, in one jitted call; its VJP task only hands the result on. Only for
    a forward whose VJP runs right after it (else the parameter gradients it holds wait
    longer than its residuals would): a step without microbatches, or a schedule that
    runs the microbatch's backward next on that stage (`fused_microbatches`). With
    `split_backward` the forward computes only I's part with it (and what W needs);
    W's task computes the rest when the schedule runs it. Dask config
    ``dagdiff.fuse-loss-backward: false`` (read when a step is built) turns it off.
    """
    low = Lowered()
    inputs = inputs or {}
    dev = (devices or {}).get
    refs: dict[int, tuple[Any, int | None]] = {}

    vjp_ops = {op.node: op for op in plan.ops if isinstance(op, Vjp)} if plan is not None else {}
    has_vjp = set(vjp_ops)
    seeds = _seeds(trace, plan, seed_scale, fuse_seeded)
    for node in trace.nodes:
        if node.kind != "call":
            if node.index in inputs:  # an existing key, or a Future of a resident value
                key, src = inputs[node.index]
                refs[node.index] = (TaskRef(key) if isinstance(key, str) else key, src)
            else:
                key = make_key(node.kind, node.path or "x", node.index, token)
                if key not in low.dsk:
                    low.add(key, DataNode(key, snapshot(node.value)), None)
                    low.data_keys[node.index] = key
                refs[node.index] = (TaskRef(key), -1)
            continue
        key = make_key("F", node.name, node.index, token, node.stage, microbatch)
        srcs, vals = _args(node, refs)
        extra: dict[str, Any] = {}
        if node.index in seeds:
            extra["seed"] = seeds[node.index]
            groups = _groups(vjp_ops[node.index]) if split_backward else []
            if len(groups) == 2:      # its I runs with it, its W later (`core.split`)
                extra["split"] = (groups[0][1], groups[1][1])
        low.add(key, Task(key, fwd_task, node.spec, srcs, dev(node.stage), *vals,
                          tag=(node.stage, microbatch), vjp=node.index in has_vjp, **extra),
                node.stage)
        low.fwd_keys[node.index] = key
        refs[node.index] = (TaskRef(key), None)   # None: take the traced leaf of the result
    if plan is None:
        return low

    def source(s: Source, dtype: Any) -> tuple[Any, int]:
        if s.op == -1:
            return np.asarray(seed_scale, dtype=dtype), -1
        return TaskRef(low.op_keys[s.op]), s.pos

    for op in plan.ops:
        if isinstance(op, Vjp):
            node = trace.nodes[op.node]
            _lower_vjp(low, node, op, token, microbatch, refs, source, split_backward,
                       dev(node.stage))
        else:
            _lower_sum(low, trace.nodes[op.node], op, token, microbatch, source, dev,
                       accumulate)
    for pnode, opi in plan.grads.items():
        if not accumulate:
            low.grad_keys[pnode] = low.op_keys[opi]
    return low


def _seeds(trace: Trace, plan: BackwardPlan | None, seed_scale: float,
           fuse: bool | Collection[int | None]) -> dict[int, tuple[Any, ...]]:
    """Call node -> the constant cotangent of each output (None: no cotangent), for the
    calls on `fuse`'s stages whose every cotangent is the loss's seed (see `lower`)."""
    if plan is None or fuse is False or not dask.config.get("dagdiff.fuse-loss-backward", True):
        return {}
    out: dict[int, tuple[Any, ...]] = {}
    for op in plan.ops:
        if not isinstance(op, Vjp) or any(c not in (None, SEED) for c in op.cts):
            continue
        node = trace.nodes[op.node]
        layer = node.spec.layer
        if (fuse is not True and node.stage not in fuse) or node.spec.remat \
                or getattr(layer, "custom", False) or not any(node.spec.diff):
            continue
        out[node.index] = tuple(None if c is None else np.asarray(seed_scale, dtype=a.dtype)
                                for c, a in zip(op.cts, node.out_avals))
    return out


def _args(node: Node, refs: dict[int, tuple[Any, int]]) -> tuple[tuple[int, ...], list[Any]]:
    """The (source index, value-or-TaskRef) of each dynamic input leaf of a call node."""
    srcs, vals = [], []
    for leaf, kind in zip(node.in_leaves, node.spec.kinds):
        if kind != "d":
            continue
        if isinstance(leaf, Traced):
            ref, src = refs[leaf.node]
            vals.append(ref)
            srcs.append(leaf.leaf if src is None else src)
        else:
            vals.append(leaf)
            srcs.append(-1)
    return tuple(srcs), vals


def _lower_vjp(low: Lowered, node: Node, op: Vjp, token: str, mb: int | None,
               refs: dict[int, tuple[Any, int]], source: Any, split: bool,
               dev: int | None) -> None:
    ct_srcs, ct_vals = [], []
    for c, aval in zip(op.cts, node.out_avals):
        if c is None:
            ct_srcs.append(None)
        else:
            v, s = _resolve(low, c, source, aval.dtype)
            ct_vals.append(v)
            ct_srcs.append(s)
    srcs, primals = _args(node, refs)
    fwd = TaskRef(low.fwd_keys[node.index])
    groups = _groups(op) if split else [("B", tuple(range(len(op.inputs))))]
    keys = []
    for i, (phase, wrt) in enumerate(groups):
        key = make_key(phase, node.name, node.index, token, node.stage, mb)
        last = i == len(groups) - 1
        # a split's I leaves on the forward's result what its W needs to skip their
        # shared work (`core.split`)
        then = {} if last else {"then": groups[i + 1][1]}
        low.add(key, Task(key, vjp_task, node.spec, srcs, wrt, tuple(ct_srcs), dev, fwd,
                          *ct_vals, *primals, release=last, **then), node.stage)
        keys.append(key)
    low.bwd_keys[node.index] = [(phase, k) for (phase, _), k in zip(groups, keys)]
    if len(groups) == 1:
        low.op_keys[op.index] = keys[0]
    else:  # positions of the split results differ: re-index through a tiny mapping
        low.op_keys[op.index] = _Split(keys, groups)  # type: ignore[assignment]


def _groups(op: Vjp) -> list[tuple[str, tuple[int, ...]]]:
    """A split backward's tasks: I (w.r.t. the activation inputs), then W (parameters);
    a group with nothing to differentiate is left out."""
    n = len(op.inputs)
    act = tuple(j for j in range(n) if not op.param_inputs[j])
    par = tuple(j for j in range(n) if op.param_inputs[j])
    return [(ph, w) for ph, w in (("I", act), ("W", par)) if w]


class _Split(str):
    """Marker for a backward op lowered as two tasks (I and W); see `_resolve`."""

    def __new__(cls, keys: list[str], groups: list[tuple[str, tuple[int, ...]]]) -> "_Split":
        obj = super().__new__(cls, keys[0])
        obj.keys = keys  # type: ignore[attr-defined]
        obj.groups = groups  # type: ignore[attr-defined]
        return obj

    def locate(self, pos: int) -> tuple[str, int]:
        for key, (_, wrt) in zip(self.keys, self.groups):  # type: ignore[attr-defined]
            if pos in wrt:
                return key, wrt.index(pos)
        raise KeyError(pos)


def _lower_sum(low: Lowered, node: Node, op: Sum, token: str, mb: int | None,
               source: Any, dev: Callable[[Any], int | None], accumulate: bool) -> None:
    srcs, vals = [], []
    aval = node.out_avals[op.leaf]
    for p in op.parts:
        v, s = _resolve(low, p, source, aval.dtype)
        vals.append(v)
        srcs.append(s)
    if op.kind == "grad":
        stage = _stage_of_parts(low, vals)
        if accumulate:
            low.grad_sums[node.index] = GradSum(tuple(srcs), tuple(vals),
                                                (aval.shape, aval.dtype), stage, dev(stage))
            return
        key = make_key("grad", node.path or node.name, node.index, token, None, mb)
    else:
        key = make_key("add", node.name, node.index, token, node.stage, mb, out=op.leaf)
        stage = node.stage
    low.add(key, Task(key, sum_task, tuple(srcs), (aval.shape, aval.dtype), dev(stage), *vals),
            stage)
    low.op_keys[op.index] = key


def _resolve(low: Lowered, p: Source, source: Any, dtype: Any) -> tuple[Any, int]:
    if p.op >= 0:
        k = low.op_keys[p.op]
        if isinstance(k, _Split):
            key, pos = k.locate(p.pos)
            return TaskRef(key), pos
    return source(p, dtype)


def _stage_of_parts(low: Lowered, vals: list[Any]) -> int | None:
    stages = {low.stage_of.get(v.key) for v in vals if isinstance(v, TaskRef)}
    return stages.pop() if len(stages) == 1 else None


def select(low: Lowered, trace: Trace, value: Traced, phase: str, token: str,
           mb: int | None = None) -> str:
    """Add a task that extracts one traced value (loss, aux) and return its key."""
    node = trace.nodes[value.node]
    key = make_key(phase, node.name, node.index, token, None, mb, out=value.leaf)
    if node.kind == "call":
        low.add(key, Task(key, select_task, value.leaf, TaskRef(low.fwd_keys[node.index])),
                node.stage)
    else:
        data = make_key(node.kind, node.path or "x", node.index, token)
        low.add(key, Task(key, select_task, -1, TaskRef(data)), None)
    return key
