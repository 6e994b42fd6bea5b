"""The backward pass as data: a reverse walk over the recorded nodes.

Like a transpose interpreter, it visits the call nodes in reverse, collects the
cotangent contributions of every value in a map keyed by (node, output leaf), and
emits a `Vjp` record per call whose outputs reach the loss, a `Sum` ("add") record
where a value fans out, and a `Sum` ("grad") record per differentiated input leaf.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .tracer import Node, Trace, Traced


__all__ = ["Source", "Vjp", "Sum", "BackwardPlan", "build_backward", "SEED"]


@dataclass(frozen=True)
class Source:
    """A cotangent contribution: output `pos` of backward op `op` (-1: the op's whole value).
    op = -1 is the seed (d loss / d loss = 1)."""

    op: int
    pos: int


SEED = Source(-1, -1)


@dataclass(frozen=True)
class Vjp:
    """VJP of call node `node`: one cotangent source (or None) per output leaf; it yields
    the cotangents of the node's differentiated inputs, in order (see `wrt_sources`)."""

    index: int
    node: int
    cts: tuple[Source | None, ...]
    inputs: tuple[tuple[int, int], ...]      # (node, leaf) of each differentiated input
    param_inputs: tuple[bool, ...]           # per differentiated input: is it a param leaf?


@dataclass(frozen=True)
class Sum:
    """Sum of contributions to value (node, leaf): kind 'add' (fan-out of an activation)
    or 'grad' (the gradient of a param leaf; zeros when it has no contribution)."""

    index: int
    kind: str
    node: int
    leaf: int
    parts: tuple[Source, ...]


@dataclass(frozen=True)
class BackwardPlan:
    """Backward ops in execution order, and the grad op of each param node."""

    ops: tuple[Vjp | Sum, ...]
    grads: dict[int, int]                    # param node index -> Sum op index


def build_backward(trace: Trace, loss: Traced) -> BackwardPlan:
    """Derive the backward ops of `trace` for the scalar `loss`."""
    contrib: dict[tuple[int, int], list[Source]] = defaultdict(list)
    contrib[(loss.node, loss.leaf)].append(SEED)
    ops: list[Vjp | Sum] = []

    def reduce(node: Node, leaf: int, kind: str) -> Source | None:
        parts = contrib.pop((node.index, leaf), [])
        if kind == "add" and len(parts) <= 1:
            return parts[0] if parts else None
        op = Sum(len(ops), kind, node.index, leaf, tuple(parts))
        ops.append(op)
        return Source(op.index, -1)

    for node in reversed(trace.nodes):
        if node.kind != "call" or not node.requires_grad:
            continue
        cts = tuple(reduce(node, i, "add") for i in range(len(node.out_avals)))
        if all(c is None for c in cts):
            continue  # this call does not reach the loss
        diff_inputs = [t for pos, t in node.traced_inputs if node.spec.diff[pos]]
        op = Vjp(
            len(ops), node.index, cts,
            tuple((t.node, t.leaf) for t in diff_inputs),
            tuple(trace.nodes[t.node].kind == "param" for t in diff_inputs),
        )
        ops.append(op)
        for j, t in enumerate(diff_inputs):
            contrib[(t.node, t.leaf)].append(Source(op.index, j))
    grads = {}
    for node in trace.nodes:
        if node.kind == "param":
            src = reduce(node, 0, "grad")
            assert src is not None
            grads[node.index] = src.op
    return BackwardPlan(tuple(ops), grads)
