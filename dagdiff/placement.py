"""Placement: which stage a layer call belongs to, and where each stage runs.

Stage k runs on worker slot ``slot<k mod n>`` of a distributed cluster (a resource
given at worker start-up, see `dd.local_cluster`), or, without a distributed client,
on local JAX device ``k mod n``. `placement={stage: slot}` overrides the mapping and
``stages="auto"`` splits an unstaged graph into balanced stages by estimated cost.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .errors import PlacementError

__all__ = [
    "stage", "current_stage", "check_stage", "Targets", "resolve_targets", "home_stages",
    "auto_stages", "node_costs", "balanced_split", "annotations_for", "resident_inputs",
]

log = logging.getLogger(__name__)
_STAGE: ContextVar[int | None] = ContextVar("dagdiff_stage", default=None)


def check_stage(value: object, where: str = "stage") -> int | None:
    """Validate a stage number (a non-negative int, or None for 'unplaced')."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"{where} must be a non-negative int or None, got {value!r}")
    return value


@contextlib.contextmanager
def stage(index: int) -> Iterator[int]:
    """Layer calls made inside ``with dd.stage(k):`` belong to stage k (unless the layer says)."""
    token = _STAGE.set(check_stage(index))
    try:
        yield index
    finally:
        _STAGE.reset(token)


def current_stage() -> int | None:
    """The stage set by the innermost `stage` block, or None."""
    return _STAGE.get()


@dataclass(frozen=True)
class Targets:
    """Where stages run: kind 'slots' (worker resources), 'workers' (addresses, for clusters
    started without slot resources), 'devices' (local JAX devices) or 'none'."""

    kind: str
    of: Mapping[int, Any]                  # stage -> slot name / worker address / device index
    addresses: Mapping[Any, str] = dataclasses.field(default_factory=dict)  # slot -> address

    def target(self, stage: int | None) -> Any:
        return None if stage is None else self.of.get(stage)


def resolve_targets(stages: set[int], client: Any, placement: Mapping[int, Any] | None
                    ) -> Targets:
    """Map each stage to its slot (with a distributed client) or local device (without)."""
    placement = dict(placement or {})
    for s in placement:
        check_stage(s, "a key of placement")
    unknown = sorted(set(placement) - set(stages))
    if unknown and stages:
        import warnings

        warnings.warn(f"placement names stage(s) {unknown} that the model does not have (its "
                      f"stages: {sorted(stages)}); those entries are ignored", stacklevel=3)
    if not stages:
        return Targets("none", {})
    if client is None:
        import jax

        n = len(jax.local_devices())
        of = {}
        for s in sorted(stages):
            d = placement.get(s, s % n)
            if not isinstance(d, int) or not 0 <= d < n:
                raise PlacementError(f"placement[{s}]={d!r}: this process has {n} JAX devices "
                                     f"(0..{n - 1}); give a device index")
            of[s] = d
        return Targets("devices", of)
    from .cluster import slot_names

    slots = slot_names(client)
    if not slots:
        from .cluster import workers_info

        workers = sorted(workers_info(client))
        if not workers:
            raise PlacementError("the distributed cluster has no workers; start some first")
        log.warning("dagdiff: workers have no slot<i> resources (start them with "
                    "`dask worker --resources slot<i>=1` or use dd.local_cluster); pinning "
                    "stages by address, which does not survive worker restarts")
        n = len(workers)
        return Targets("workers", {s: workers[placement.get(s, s % n) % n] for s in stages})
    by_slot = {name: addr for addr, name in slots.items()}
    names = sorted(by_slot, key=lambda x: int(x[4:]) if x[4:].isdigit() else 1 << 30)
    of = {}
    for s in sorted(stages):
        want = placement.get(s, s % len(names))
        name = f"slot{want}" if isinstance(want, int) else str(want)
        if isinstance(want, int) and not 0 <= want < len(names):
            raise PlacementError(f"placement[{s}]={want}: the cluster has {len(names)} slots "
                                 f"({', '.join(names)})")
        if name not in by_slot:
            raise PlacementError(f"placement[{s}]={want!r}: no worker has resource {name!r}; "
                                 f"slots are {', '.join(names)}")
        of[s] = name
    return Targets("slots", of, by_slot)


def home_stages(trace: Any) -> dict[int, int | None]:
    """Input/param node -> the stage of its first consumer (where its data should live)."""
    from .tracer import Traced

    home: dict[int, int | None] = {}
    for n in trace.nodes:
        if n.kind != "call":
            continue
        for x in n.in_leaves:
            if isinstance(x, Traced) and trace.nodes[x.node].kind != "call":
                home.setdefault(x.node, n.stage)
    return home


def annotations_for(stage_of: Mapping[str, int | None], targets: Targets) -> dict[str, Any]:
    """Per-key Dask annotations (as `dict.get` callables, picklable for the scheduler)."""
    if targets.kind in ("none", "devices"):
        return {}
    per_key: dict[str, Any] = {}
    for key, s in stage_of.items():
        t = targets.target(s)
        if t is None:
            continue
        per_key[key] = {t: 1} if targets.kind == "slots" else [t]
    if targets.kind == "slots":
        return {"resources": per_key.get}
    return {"workers": per_key.get, "allow_other_workers": {k: True for k in per_key}.get}


# --- parameters that stay on their workers across calls ------------------------------

_RESIDENT: "weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, Any, Any]]]" = \
    weakref.WeakKeyDictionary()


def resident_inputs(trace: Any, client: Any, targets: Targets, home: Mapping[int, int | None],
                    kinds: tuple[str, ...] = ("param",)) -> dict[int, tuple[Any, int]]:
    """Scatter input values of the given node kinds to the worker of their stage once, and
    reuse the Future while the same array object is alive and its future still valid.

    Returns {node index: (Future, -1)} for `lower(inputs=...)`."""
    import jax
    import numpy as np

    cache = _RESIDENT.setdefault(client, {})
    out: dict[int, tuple[Any, int]] = {}
    todo: list[tuple[int, Any, list[str] | None, Any]] = []
    for n in trace.nodes:
        if n.kind not in kinds or not isinstance(n.value, (jax.Array, np.ndarray)):
            continue
        hit = cache.get(id(n.value))
        stamp = None if isinstance(n.value, jax.Array) else _np_stamp(n.value)
        if (hit is not None and hit[0]() is n.value and hit[2] == stamp
                and hit[1].status == "finished"):
            out[n.index] = (hit[1], -1)
            continue
        t = targets.target(home.get(n.index))
        addr = targets.addresses.get(t) if targets.kind == "slots" else t
        todo.append((n.index, n.value, [addr] if isinstance(addr, str) else None, stamp))
    for idx, value, workers, stamp in todo:
        fut = client.scatter(value, workers=workers, hash=False)
        try:
            ref = weakref.ref(value)
        except TypeError:
            out[idx] = (fut, -1)
            continue
        ident = id(value)
        cache[ident] = (ref, fut, stamp)
        weakref.finalize(value, cache.pop, ident, None)
        out[idx] = (fut, -1)
    return out


def _np_stamp(a: Any) -> str:
    from dask.base import tokenize

    return tokenize(a)


# --- stages="auto": balance a chain by estimated cost --------------------------------

def node_costs(trace: Any) -> list[float]:
    """Estimated cost of each call node (forward FLOPs from XLA's cost analysis, x3 for
    forward + backward); falls back to output bytes where the analysis is unavailable."""
    import jax

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
    from .tracer import Trace

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
