"""Fusion: consecutive layer calls on one stage become one layer - one forward and one VJP
task, one jitted function - for when per-layer tasks are too small for the scheduler."""
from __future__ import annotations

import dataclasses
from itertools import groupby
from typing import Any, Iterable

import jax

from .layer import Layer
from .spec import CallSpec, make_call_spec
from .tracer import Node, Trace, Traced, aval_of


__all__ = ["Segment", "fuse_trace", "run_length_name"]


class Segment:
    """The function of a fused run of layer calls: replays them in order on external
    inputs and returns the outputs used outside the run. Layers with ``remat=True`` are
    wrapped in `jax.checkpoint` inside the fused function."""

    def __init__(self, steps: tuple[tuple[CallSpec, tuple[tuple[int, ...], ...]], ...],
                 outputs: tuple[tuple[int, int], ...], layers: tuple[str, ...]) -> None:
        self.steps = steps
        self.outputs = outputs
        self.layers = layers

    def __call__(self, *ext: Any) -> tuple[Any, ...]:
        vals: list[list[Any]] = []
        for spec, refs in self.steps:
            dyn = [ext[r[1]] if r[0] == 0 else vals[r[1]][r[2]] for r in refs]
            call = jax.checkpoint(spec.call) if spec.remat else spec.call
            vals.append(jax.tree_util.tree_leaves(call(dyn)))
        return tuple(vals[s][leaf] for s, leaf in self.outputs)

    def functions(self) -> tuple[Any, ...]:
        """The functions of its layers (what `byvalue.reads` looks into)."""
        return tuple(f for spec, _ in self.steps for f in spec.layer.functions())

    def __dask_tokenize__(self) -> Any:
        return ("dagdiff.Segment", tuple((s.fingerprint, r) for s, r in self.steps),
                self.outputs)

    def __repr__(self) -> str:
        return f"Segment({', '.join(self.layers)})"


def run_length_name(names: Iterable[str]) -> str:
    """'dense, dense, dense, mse' -> 'dense_x3_mse' (short, readable in the dashboard)."""
    parts = []
    for name, grp in groupby(names):
        n = len(list(grp))
        parts.append(name if n == 1 else f"{name}_x{n}")
    text = "_".join(parts)
    return text if len(text) <= 48 else text[:45] + "_etc"


def fuse_trace(trace: Trace, keep: set[tuple[int, int]]
               ) -> tuple[Trace, dict[tuple[int, int], Traced]]:
    """Return a new trace in which each maximal run of consecutive call nodes on the same
    stage is one node, and the map from old (node, leaf) to new traced values.

    `keep` lists values that must stay visible (loss, aux outputs)."""
    new = Trace(trace.name)
    remap: dict[tuple[int, int], Traced] = {}
    calls = [n for n in trace.nodes if n.kind == "call"]
    for n in trace.nodes:
        if n.kind != "call":
            node = dataclasses.replace(n, index=len(new.nodes))
            new.nodes.append(node)
            remap[(n.index, 0)] = Traced(new, node.index, 0, n.out_avals[0], n.requires_grad)
    seg_of: dict[int, int] = {}
    segments: list[list[Node]] = []
    for _, grp in groupby(calls, key=lambda n: n.stage):
        # hand-written (custom) layers stay on their own: their rules are not JAX
        for custom, run in groupby(grp, key=_is_custom):
            parts = [[n] for n in run] if custom else [list(run)]
            for part in parts:
                segments.append(part)
                for n in part:
                    seg_of[n.index] = len(segments) - 1
    used_outside: set[tuple[int, int]] = set(keep)
    for n in calls:
        for x in n.in_leaves:
            if isinstance(x, Traced) and seg_of.get(x.node, -1) != seg_of[n.index]:
                used_outside.add((x.node, x.leaf))

    def mapped(x: Any) -> Any:
        return remap[(x.node, x.leaf)] if isinstance(x, Traced) else x

    for seg in segments:
        if len(seg) == 1:
            n = seg[0]
            node = dataclasses.replace(n, index=len(new.nodes),
                                       in_leaves=tuple(mapped(x) for x in n.in_leaves))
            new.nodes.append(node)
            for i, a in enumerate(n.out_avals):
                remap[(n.index, i)] = Traced(new, node.index, i, a,
                                             n.requires_grad and _inexact(a))
            continue
        _fuse(new, seg, used_outside, remap, mapped)
    new.closed = True
    return new, remap


def _inexact(aval: Any) -> bool:
    return bool(jax.dtypes.issubdtype(aval.dtype, jax.numpy.inexact))


def _fuse(new: Trace, seg: list[Node], used_outside: set[tuple[int, int]],
          remap: dict[tuple[int, int], Traced], mapped: Any) -> None:
    local = {n.index: i for i, n in enumerate(seg)}
    ext: list[Any] = []
    ext_index: dict[Any, int] = {}
    steps = []
    for n in seg:
        refs = []
        for x, kind in zip(n.in_leaves, n.spec.kinds):
            if kind != "d":
                continue
            if isinstance(x, Traced) and x.node in local:
                refs.append((1, local[x.node], x.leaf))
                continue
            k = (x.node, x.leaf) if isinstance(x, Traced) else ("const", id(x))
            if k not in ext_index:
                ext_index[k] = len(ext)
                ext.append(mapped(x))
            refs.append((0, ext_index[k]))
        steps.append((n.spec, tuple(refs)))
    outputs, avals, flags = [], [], []
    for n in seg:
        for i, a in enumerate(n.out_avals):
            if (n.index, i) in used_outside:
                outputs.append((local[n.index], i))
                avals.append(a)
                flags.append((n.index, i, n.requires_grad and _inexact(a)))
    layers = tuple(n.name for n in seg)
    stage = seg[0].stage
    prefix = f"s{stage}" if stage is not None else "seg"
    fn = Segment(tuple(steps), tuple(outputs), layers)
    layer = Layer(fn, name=f"{prefix}_{run_length_name(layers)}", stage=stage)
    treedef = jax.tree_util.tree_structure((tuple(range(len(ext))), {}))
    diff = tuple(isinstance(x, Traced) and x.requires_grad for x in ext)
    spec = make_call_spec(layer, treedef, ("d",) * len(ext), (None,) * len(ext), diff)
    spec = spec.with_outputs(tuple(avals), [x.aval if isinstance(x, Traced) else aval_of(x)
                                            for x in ext])
    node = Node(index=len(new.nodes), kind="call", name=layer.name, stage=stage,
                out_treedef=jax.tree_util.tree_structure(tuple(range(len(avals)))),
                out_avals=tuple(avals), requires_grad=any(diff), spec=spec,
                in_leaves=tuple(ext))
    new.nodes.append(node)
    for j, (old, leaf, rg) in enumerate(flags):
        remap[(old, leaf)] = Traced(new, node.index, j, avals[j], rg and node.requires_grad)


def _is_custom(n: Node) -> bool:
    return bool(n.spec is not None and getattr(n.spec.layer, "custom", False))
