"""Measurements for a `Profile`: each recorded action's times, the hops between workers, how
workers on one host slow each other, the bandwidth between two workers, and what a
trace's stages send and keep (bytes)."""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ..core.footprint import nbytes
from ..core.tracer import Trace, home_stages
from ..inspect.record import Recording

__all__ = ["KINDS", "Segments", "edge_bytes", "stage_facts", "nbytes", "ActionTime", "stage_actions", "hop_samples", "overlap_segments", "work", "fit_contention", "measure_bandwidth"]

#: the action kinds a profile times (forward, full backward, input grad, weight grad)
KINDS = ("F", "B", "I", "W")



def edge_bytes(trace: Trace) -> dict[tuple[int, int], int]:
    """(src, dst) stages -> bytes per microbatch: activations forward along every edge
    between layers of two stages, cotangents back along those that need a gradient."""
    seen: set[tuple[int, int, int]] = set()
    out: dict[tuple[int, int], int] = defaultdict(int)
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None:
            continue
        for _, x in n.traced_inputs:
            src = trace.nodes[x.node]
            if src.kind != "call" or src.stage is None or src.stage == n.stage:
                continue
            if (x.node, x.leaf, n.stage) in seen:
                continue
            seen.add((x.node, x.leaf, n.stage))
            out[(src.stage, n.stage)] += nbytes(x.aval)
            if x.requires_grad:
                out[(n.stage, src.stage)] += nbytes(x.aval)
    return dict(out)


def stage_facts(trace: Trace) -> list[dict[str, Any]]:
    """Per stage (0..S-1): bytes it sends forward and back, activation bytes per live
    microbatch, parameter bytes, and the names of its layer calls."""
    count = trace.num_stages
    if not count:
        return []
    facts = [{"send_forward": 0, "send_backward": 0, "activation_bytes": 0, "param_bytes": 0,
              "layers": []} for _ in range(count)]
    for (src, dst), n in edge_bytes(trace).items():
        facts[src]["send_forward" if dst > src else "send_backward"] += n
    kept: list[set[tuple[int, int]]] = [set() for _ in range(count)]
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None:
            continue
        facts[n.stage]["layers"].append(n.name)
        for _, x in n.traced_inputs:
            if trace.nodes[x.node].kind != "param" and (x.node, x.leaf) not in kept[n.stage]:
                kept[n.stage].add((x.node, x.leaf))
                facts[n.stage]["activation_bytes"] += nbytes(x.aval)
        for leaf, aval in enumerate(n.out_avals):
            if (n.index, leaf) not in kept[n.stage]:
                kept[n.stage].add((n.index, leaf))
                facts[n.stage]["activation_bytes"] += nbytes(aval)
    for node, stage in home_stages(trace).items():
        if stage is not None and trace.nodes[node].kind == "param":
            facts[stage]["param_bytes"] += nbytes(trace.nodes[node].out_avals[0])
    return facts




class ActionTime(NamedTuple):
    """One F/B/I/W action read from a recording: its worker, first start and last stop,
    its cost (seconds of compute, its program's small tasks included) and the (start,
    stop) of each task that cost is made of."""

    worker: str
    start: float
    stop: float
    cost: float
    parts: tuple[tuple[float, float], ...]


def stage_actions(rec: Recording) -> dict[tuple[str, int, int], ActionTime]:
    """(kind, stage, microbatch) -> `ActionTime` of each F/B/I/W action in `rec`. Its cost
    is the action's compute time plus that of the small tasks its program runs with it:
    a microbatch's input ``split`` before its F, and the ``acc``/``loss``/``add`` tasks
    right after an action (until the program ends: a task without a microbatch, e.g.
    ``done``, ends the chain). Several tasks of one action (a stage of unfused layers)
    add up."""
    out: dict[tuple[str, int, int], list[Any]] = {}
    for wk in rec.workers:
        tasks = sorted((t for t in rec.tasks if t.worker == wk and t.phase != "transfer"),
                       key=lambda t: (t.start, t.stop))
        split: dict[int, list[tuple[float, float]]] = defaultdict(list)
        last: tuple[str, int, int] | None = None
        for t in tasks:
            span = (t.start, max(t.stop, t.start))
            if t.phase in KINDS and t.stage is not None and t.microbatch is not None:
                key = (t.phase, t.stage, t.microbatch)
                parts = [span, *(split.pop(t.microbatch, []) if t.phase == "F" else [])]
                a = out.get(key)
                if a is None:
                    out[key] = [wk, t.start, t.stop, parts]
                else:
                    a[1], a[2] = min(a[1], t.start), max(a[2], t.stop)
                    a[3] += parts
                last = key
            elif t.microbatch is None:
                last = None
            elif t.phase == "split":
                split[t.microbatch].append(span)
            elif last is not None:
                out[last][3].append(span)
    return {k: ActionTime(v[0], v[1], v[2], sum(b - a for a, b in v[3]),
                          tuple(sorted(v[3]))) for k, v in out.items()}


def hop_samples(rec: Recording, acts: Mapping[tuple[str, int, int], ActionTime],
                num_stages: int, edge_bytes: Mapping[tuple[int, int], int] | None = None
                ) -> list[tuple[float, int]]:
    """(seconds, bytes) of each cross-worker dependency in `rec` whose consumer waited
    for it (its worker's previous task ended before the producer's action did):
    consumer start - producer end, the delay a hop adds. Forward: F at g after F at
    g - 1; backward: B/I at g (W where the stage has no I) after B/I at g + 1."""
    edge_bytes = edge_bytes or {}
    stops: dict[str, list[float]] = defaultdict(list)
    for t in rec.tasks:
        if t.phase != "transfer":
            stops[t.worker].append(t.stop)
    for v in stops.values():
        v.sort()
    out = []
    for (kind, g, mb), a in acts.items():
        if kind == "F":
            src = ("F", g - 1, mb) if g > 0 else None
        elif kind in ("B", "I") or (kind == "W" and ("I", g, mb) not in acts):
            src = next((k for k in (("B", g + 1, mb), ("I", g + 1, mb)) if k in acts), None) \
                if g + 1 < num_stages else None
        else:
            src = None
        if src is None or src not in acts:
            continue
        prod = acts[src]
        if prod.worker == a.worker or a.start < prod.stop:
            continue
        at = bisect.bisect_right(stops[a.worker], a.start + 1e-9)
        prev = stops[a.worker][at - 1] if at else float("-inf")
        if prev <= prod.stop + 1e-6:
            out.append((a.start - prod.stop, int(edge_bytes.get((src[1], g), 0))))
    return out


Segments = dict[tuple[str, int, int], list[tuple[float, int]]]


def overlap_segments(acts: Mapping[tuple[str, int, int], ActionTime],
                     host_of: Callable[[str], Any] | None = None) -> Segments:
    """Per action, its tasks cut into (seconds, n): n = how many workers of its host
    (itself included) were running an action then. `host_of`: worker -> host (default:
    one host)."""
    host = host_of or (lambda w: 0)
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a in acts.values():
        busy[a.worker].extend(a.parts)
    out: Segments = {}
    for key, a in acts.items():
        others = [ivs for w, ivs in busy.items() if w != a.worker and host(w) == host(a.worker)]
        segs = []
        for x, y in a.parts:
            cuts = sorted({x, y, *(e for ivs in others for iv in ivs for e in iv if x < e < y)})
            for u, v in zip(cuts, cuts[1:]):
                mid = (u + v) / 2
                n = 1 + sum(any(s <= mid < e for s, e in ivs) for ivs in others)
                segs.append((v - u, n))
        out[key] = segs
    return out


def work(segments: Sequence[tuple[float, int]], contention: float) -> float:
    """Seconds an action would take alone on its host, from its `overlap_segments`: each
    piece shared with n - 1 other busy workers ran at 1 / (1 + contention x (n - 1))."""
    return sum(d / (1.0 + contention * (n - 1)) for d, n in segments)


def fit_contention(runs: Sequence[Segments], grid: int = 20) -> float:
    """The contention in [0, 1] (steps of 1 / `grid`) under which the actions of each
    (kind, stage) have the most equal alone-times (`work`): the smallest mean relative
    spread (stdev / mean, weighted by samples). 0 when nothing ever overlapped."""
    if not any(n > 1 for segs in runs for ss in segs.values() for _, n in ss):
        return 0.0
    best, best_c = float("inf"), 0.0
    for k in range(grid + 1):
        c = k / grid
        groups: dict[tuple[str, int], list[float]] = defaultdict(list)
        for segs in runs:
            for (kind, g, _mb), ss in segs.items():
                groups[(kind, g)].append(work(ss, c))
        spread = total = 0.0
        for xs in groups.values():
            mean = statistics.fmean(xs)
            if len(xs) >= 2 and mean > 0:
                spread += statistics.pstdev(xs) / mean * len(xs)
                total += len(xs)
        score = spread / total if total else 0.0
        if score < best - 1e-12:
            best, best_c = score, c
    return best_c


def _fill(n: int, seed: int) -> Any:
    return np.full(n, seed % 251, dtype=np.uint8)


def _size(x: Any) -> int:
    return int(x.nbytes)


def measure_bandwidth(client: Any, src: str, dst: str,
                      sizes: tuple[int, int] = (1 << 16, 1 << 24), repeat: int = 3
                      ) -> float | None:
    """Bytes/s between workers `src` and `dst` (addresses): Dask transfers of two payload
    sizes, the size difference over the difference of their median transfer times (from
    the task stream); None where the larger one was not slower (too noisy)."""
    from distributed import get_task_stream, wait

    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeat):
        for n in sizes:
            x = client.submit(_fill, n, r, workers=[src], pure=False)
            with client.as_current():
                wait(x)
            with get_task_stream(client) as ts:
                y = client.submit(_size, x, workers=[dst], pure=False)
                y.result()
            for d in ts.data:
                for ss in d.get("startstops", ()):
                    if ss.get("action") == "transfer":
                        times[n].append(ss["stop"] - ss["start"])
            del x, y
    if not all(times.values()):
        return None
    small, big = (statistics.median(times[n]) for n in sizes)
    return (sizes[1] - sizes[0]) / (big - small) if big > small else None

