"""`stages="auto"`: split an unstaged trace into stages balanced by estimated cost (XLA's
estimate, or measured times from a `CostSource` such as `dd.Profile`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import jax

from ..errors import PlacementError
from .tracer import Trace


__all__ = ["CostSource", "node_costs", "balanced_split", "auto_stages", "is_cost_source"]


@runtime_checkable
class CostSource(Protocol):
    """Measured costs to balance stages by (`dd.Profile` is one): how many stages to make,
    and the cost of each call node of an unstaged trace (``stages=profile``)."""

    @property
    def num_stages(self) -> int:
        """How many stages to split the model into."""

    def layer_costs_for(self, trace: Any) -> list[float]:
        """One cost (seconds) per call node of `trace`, in trace order; raises a
        DagdiffError when `trace` is not the model the costs were measured on."""


def is_cost_source(value: object) -> bool:
    """True for an object `auto_stages` can take costs from (`CostSource`)."""
    return not isinstance(value, (str, int, type)) and isinstance(value, CostSource)


def node_costs(trace: Any) -> list[float]:
    """Estimated cost of each call node (forward FLOPs from XLA's cost analysis, x3 for
    forward + backward); falls back to output bytes where the analysis is unavailable."""
    cache: dict[str, float] = {}
    out = []
    for n in trace.nodes:
        if n.kind != "call":
            continue
        fp = n.spec.fingerprint
        if fp not in cache:
            avals = [x.aval if hasattr(x, "aval") else jax.ShapeDtypeStruct(x.shape, x.dtype)
                     for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
            flops = 0.0
            try:
                spec = n.spec
                ca = jax.jit(lambda *d: spec.call(list(d))).lower(*avals).cost_analysis()
                ca = ca[0] if isinstance(ca, (list, tuple)) else ca
                flops = float((ca or {}).get("flops", 0.0))
            except Exception:  # pragma: no cover - backend without cost analysis
                flops = 0.0
            size = float(sum(a.size if hasattr(a, "size") else 0 for a in n.out_avals))
            cache[fp] = 3.0 * flops if flops > 0 else size
        out.append(cache[fp])
    return out


def balanced_split(costs: list[float], k: int) -> list[int]:
    """Stage index of each item so that contiguous groups have the smallest max total cost."""
    if k < 1:
        raise PlacementError(f"need at least 1 stage, got {k}")
    if not costs:
        return []
    k = min(k, len(costs))

    def groups(limit: float) -> int:
        n, acc = 1, 0.0
        for c in costs:
            if acc + c > limit and acc > 0:
                n, acc = n + 1, c
            else:
                acc += c
        return n

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if groups(mid) <= k:
            hi = mid
        else:
            lo = mid
    stages, s, acc = [], 0, 0.0
    remaining = len(costs)
    for c in costs:
        # open a new stage when over the limit, or when each remaining stage needs an item
        if (acc + c > hi and acc > 0) or (k - s - 1 >= remaining and acc > 0):
            s, acc = s + 1, 0.0
        stages.append(min(s, k - 1))
        acc += c
        remaining -= 1
    return stages


def auto_stages(trace: Any, n: int, costs: Sequence[float] | None = None) -> Any:
    """A copy of `trace` whose unstaged call nodes are split into `n` balanced stages, by
    `costs` (one per call node, e.g. measured seconds) or else XLA's `node_costs`."""
    calls = [x for x in trace.nodes if x.kind == "call"]
    if any(x.stage is not None for x in calls):
        raise PlacementError("stages='auto' needs an unstaged model, but some layers have "
                             "stages; drop stage=/dd.stage or pass stages=None")
    if costs is None:
        costs = node_costs(trace)
    elif len(costs) != len(calls) or any(
            not isinstance(c, (int, float)) or isinstance(c, bool) or c < 0 for c in costs):
        raise PlacementError(f"stage balancing got {len(costs)} costs for {len(calls)} layer "
                             f"calls (or a cost that is not a number >= 0): {list(costs)[:8]}; "
                             "pass one cost >= 0 per layer call, in trace order")
    split = iter(balanced_split([float(c) for c in costs], n))
    new = Trace(trace.name)
    new.nodes = [dataclasses.replace(x, stage=next(split)) if x.kind == "call" else x
                 for x in trace.nodes]
    new.closed = True  # node indices are unchanged, so traced inputs still resolve
    return new
