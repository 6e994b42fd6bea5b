"""`stages="auto"`: split an unstaged trace into stages balanced by estimated cost."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ..errors import PlacementError
from .tracer import Trace


__all__ = ["node_costs", "balanced_split", "auto_stages"]


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


def auto_stages(trace: Any, n: int) -> Any:
    """A copy of `trace` whose unstaged call nodes are split into `n` balanced stages."""
    calls = [x for x in trace.nodes if x.kind == "call"]
    if any(x.stage is not None for x in calls):
        raise PlacementError("stages='auto' needs an unstaged model, but some layers have "
                             "stages; drop stage=/dd.stage or pass stages=None")
    split = iter(balanced_split(node_costs(trace), n))
    new = Trace(trace.name)
    new.nodes = [dataclasses.replace(x, stage=next(split)) if x.kind == "call" else x
                 for x in trace.nodes]
    new.closed = True  # node indices are unchanged, so traced inputs still resolve
    return new
