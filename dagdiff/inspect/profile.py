"""`dd.profile`: one real pipeline step measured per stage (F, B, I, W times, bytes sent,
hop latency between workers) into a `Profile`, the cost model of `dd.predict`."""
from __future__ import annotations

import bisect
import functools
import html
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import dask
import jax
import numpy as np
from distributed.comm.addressing import get_address_host

from ..build import Build, Options, build, trace_model
from ..cluster.info import current_client, workers_info
from ..core.auto import node_costs
from ..core.tracer import Trace, home_stages
from ..errors import ArgumentError
from ..schedules import Interleaved, InterleavedZeroBubble, LoopedBFS, Schedule, get_schedule
from .record import Recording, record


__all__ = ["StageProfile", "LayerCost", "Profile", "profile", "ActionTime", "stage_actions",
           "hop_samples", "overlap_segments", "work", "fit_contention", "measure_bandwidth",
           "KINDS"]

#: the action kinds a profile times (forward, full backward, input grad, weight grad)
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class StageProfile:
    """One global stage, measured: seconds per microbatch of each action kind (medians
    over the microbatches; a program's split/accumulate/loss tasks are counted with the
    action they belong to), and bytes per microbatch.

    ``i`` is 0 where the stage computes no input gradient (stage 0 of a model whose
    input is data); ``b`` and ``i``/``w`` come from the full- and split-backward
    schedules the profile ran (when only one kind ran: I = W = B / 2, or B = I + W).
    ``send_forward``: activation bytes it sends to later stages; ``send_backward``:
    cotangent bytes it sends to earlier stages; ``activation_bytes``: what one live
    microbatch keeps on its worker (the inputs and outputs of the stage's layer calls
    before fusion, parameters left out: an estimate from the traced avals);
    ``param_bytes``: its parameters."""

    stage: int
    worker: str
    f: float
    b: float
    i: float
    w: float
    send_forward: int
    send_backward: int
    activation_bytes: int
    param_bytes: int
    layers: tuple[str, ...]
    samples: int

    def cost(self, kind: str) -> float:
        """Seconds of one action of `kind` (F, B, I or W)."""
        return {"F": self.f, "B": self.b, "I": self.i, "W": self.w}[kind]


@dataclass(frozen=True)
class LayerCost:
    """One layer call of the profiled model (trace order): its stage, XLA's cost estimate
    and the measured seconds per microbatch (forward + backward) it is given: its
    stage's measured time shared out in proportion to the estimates."""

    name: str
    stage: int
    seconds: float
    estimate: float


@dataclass(frozen=True)
class Profile:
    """What one real step per schedule measured on a cluster: per stage (`stages`, global
    stage order) the times and bytes of `StageProfile`; the hop latency between workers
    (``hop_latency`` s: median, over ``hop_samples`` dependencies whose consumer was
    waiting, of consumer start - producer end, moving ``hop_bytes`` bytes); the
    bandwidth between two workers (bytes/s, None if not measured); per layer call the
    `LayerCost` that ``stages=profile`` balances by; ``edges``: (src, dst, bytes per
    microbatch) between stages; ``step_overhead``: seconds of a whole step (submit to
    result) outside its first to last action (median; 0 when not timed);
    ``contention``: how much workers on one host slow each other down (0: not at all,
    1: they share it evenly; fitted to the recorded actions, see `simulate`), in which
    case the stage times are alone-times; ``hosts``: each worker's host, by slot. Times
    are per microbatch at ``microbatches`` microbatches (`stage_costs` scales them to
    another count).

    ``dd.predict(schedule, profile)`` simulates a schedule on these costs;
    ``dd.value_and_grad(fn, ..., stages=profile)`` splits an unstaged `fn` into
    ``num_stages`` stages balanced by the measured times."""

    stages: tuple[StageProfile, ...]
    workers: int
    microbatches: int
    hop_latency: float
    hop_bytes: int
    hop_samples: int
    bandwidth: float | None
    layers: tuple[LayerCost, ...]
    schedules: tuple[str, ...]
    edges: tuple[tuple[int, int, int], ...] = ()
    step_overhead: float = 0.0
    contention: float = 0.0
    hosts: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        """How many global stages the profiled model has."""
        return len(self.stages)

    @property
    def param_bytes(self) -> int:
        return sum(s.param_bytes for s in self.stages)

    def scale(self, microbatches: int | None) -> float:
        """Factor from the profiled microbatch size to that of `microbatches` (the same
        batch cut into more parts: smaller microbatches, proportionally less time and
        bytes per action; fixed per-action costs are not modelled)."""
        if microbatches is None:
            return 1.0
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) \
                or microbatches < 1:
            raise ArgumentError(f"microbatches must be a positive int, got {microbatches!r}")
        return self.microbatches / microbatches

    def stage_costs(self, microbatches: int | None = None) -> dict[int, dict[str, float]]:
        """Per global stage, seconds of one F, B, I and W action at `microbatches`
        (default: the profiled count): what `simulate(stage_costs=...)` takes."""
        k = self.scale(microbatches)
        return {s.stage: {kind: s.cost(kind) * k for kind in KINDS} for s in self.stages}

    def edge_bytes(self) -> dict[tuple[int, int], int]:
        """(src, dst) global stages -> bytes per microbatch sent along that edge
        (forward edges from `edges`, and the cotangents back along each)."""
        out: dict[tuple[int, int], int] = {}
        for src, dst, n in self.edges:
            out[(src, dst)] = out.get((src, dst), 0) + n
        return out

    def comm_time(self, nbytes: float) -> float:
        """Predicted seconds of one hop carrying `nbytes`: the measured hop latency, moved
        by the size difference over the bandwidth when that was measured."""
        if self.bandwidth:
            return max(0.0, self.hop_latency + (nbytes - self.hop_bytes) / self.bandwidth)
        return self.hop_latency

    def edge_comm(self, microbatches: int | None = None) -> dict[tuple[int, int], float]:
        """Seconds per cross-worker dependency of the simulator, (g - 1, g) forward and
        (g + 1, g) backward for every stage g, at `microbatches`: what
        `simulate(edge_comm=...)` takes."""
        k = self.scale(microbatches)
        nb = self.edge_bytes()
        out = {}
        for g in range(1, self.num_stages):
            out[(g - 1, g)] = self.comm_time(nb.get((g - 1, g), 0) * k)
            out[(g, g - 1)] = self.comm_time(nb.get((g, g - 1), 0) * k)
        return out

    def layer_costs_for(self, trace: Any) -> list[float]:
        """Measured seconds of each call node of `trace` (``stages=profile``); raises
        ArgumentError unless `trace` has the profiled model's layer calls, in order."""
        calls = [n.name for n in trace.nodes if n.kind == "call"]
        mine = [c.name for c in self.layers]
        if calls != mine:
            first = next((k for k, (a, b) in enumerate(zip(calls, mine)) if a != b),
                         min(len(calls), len(mine)))
            raise ArgumentError(
                f"stages=profile: the profile was taken on a model of {len(mine)} layer "
                f"calls ({_summary(mine)}), this one has {len(calls)} ({_summary(calls)}); "
                f"they differ at call {first}; fix: profile this model (dd.profile(fn, "
                "stages=...)(*args)) and pass that profile")
        return [c.seconds for c in self.layers]

    @classmethod
    def from_recording(cls, recording: Recording, build: Build, *,
                       also: Sequence[tuple[Recording, Build]] = (),
                       raw_trace: Trace | None = None,
                       bandwidth: float | None = None,
                       walls: Sequence[float] = (),
                       contention: float | None = None) -> "Profile":
        """A Profile from `dd.record` recordings of pipeline steps: `recording` of one
        step of `build` (a `dagdiff.build.build` result), and in `also` more (recording,
        build) pairs of the same model (other schedules: a split-backward one gives I
        and W). `raw_trace`: the staged trace before fusion, whose layer calls get
        `LayerCost`s (default: the build's trace). `bandwidth` in bytes/s if measured;
        `walls`: the whole-step seconds of the recordings, in order (`step_overhead`).
        `contention`: how workers on one host slow each other (see `simulate`); None fits
        it to the recordings (`fit_contention`), and the stage times are then each
        action's alone-time (`work`)."""
        runs = [(recording, build), *also]
        for rec, b in runs:
            if not isinstance(rec, Recording) or not isinstance(b, Build):
                raise ArgumentError(
                    f"Profile.from_recording takes (Recording, Build) pairs, got "
                    f"{type(rec).__name__}, {type(b).__name__}; fix: record a step with "
                    "`with dd.record(client) as rec:` and pass it with the step's Build")
            if not b.options.pipelined:
                raise ArgumentError("Profile.from_recording needs the Build of a pipeline step "
                                    "(microbatches=/schedule=); fix: build with a schedule")
        model = build.model
        facts = _stage_facts(model.trace)
        nstages = len(facts)
        if not nstages:
            raise ArgumentError("Profile.from_recording: the model has no staged layers; fix: "
                                "stage it (dd.stage, stage=, or stages='auto'/an int)")
        samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        hops: list[tuple[float, int]] = []
        overheads: list[float] = []
        ebytes = _edge_bytes(model.trace)
        names: list[str] = []
        if contention is not None and not (isinstance(contention, (int, float))
                                           and not isinstance(contention, bool)
                                           and contention >= 0):
            raise ArgumentError(f"Profile.from_recording: contention must be a number >= 0 "
                                f"or None (fit it), got {contention!r}")
        segments: list[Segments] = []
        for rec, b in runs:
            acts = stage_actions(rec)
            if not acts:
                raise ArgumentError(
                    "Profile.from_recording: the recording holds no F/B/I/W action; fix: "
                    "compute the step inside `with dd.record(client) as rec:`")
            segments.append(overlap_segments(acts, _host))
            hops += hop_samples(rec, acts, nstages, ebytes)
            name = b.options.schedule.name if b.options.schedule else "none"
            if name not in names:
                names.append(name)
            if len(overheads) < len(walls):
                span = max(a.stop for a in acts.values()) - min(a.start for a in acts.values())
                overheads.append(max(walls[len(overheads)] - span, 0.0))
        c = fit_contention(segments) if contention is None else float(contention)
        for segs in segments:
            for (kind, stage, _mb), ss in segs.items():
                samples[(kind, stage)].append(work(ss, c))
        slot_of = {s: str(w) for s, w in build.targets.of.items()}
        raw = raw_trace if raw_trace is not None else model.trace
        raw_facts = _stage_facts(raw)       # per layer: the values a live microbatch keeps
        raw_layers: dict[int, list[str]] = defaultdict(list)
        for n in raw.nodes:
            if n.kind == "call" and n.stage is not None:
                raw_layers[n.stage].append(n.name)
        stages = []
        for g in range(nstages):
            med = {k: statistics.median(samples[(k, g)]) if samples.get((k, g)) else None
                   for k in KINDS}
            if med["F"] is None:
                raise ArgumentError(
                    f"Profile.from_recording: no forward of stage {g} was recorded (stages "
                    f"seen: {sorted({s for _, s in samples})}); fix: record a whole step")
            f, bb, i, w = med["F"], med["B"], med["I"], med["W"]
            if bb is None and (i is None and w is None):
                raise ArgumentError(f"Profile.from_recording: no backward of stage {g} was "
                                    "recorded; fix: record a whole step")
            if bb is None:
                bb = (i or 0.0) + (w or 0.0)
            if w is None:
                i, w = (bb / 2, bb / 2) if i is None else (i, max(bb - i, 0.0))
            elif i is None:
                i = 0.0      # a split-backward step ran W but no I: no input gradient here
            fa = facts[g]
            stages.append(StageProfile(
                stage=g, worker=slot_of.get(g, "?"), f=f, b=bb, i=i, w=w,
                send_forward=fa["send_forward"], send_backward=fa["send_backward"],
                activation_bytes=(raw_facts[g] if g < len(raw_facts) else fa)["activation_bytes"],
                param_bytes=fa["param_bytes"],
                layers=tuple(raw_layers.get(g) or fa["layers"]),
                samples=len(samples[("F", g)])))
        if hops:
            latency = statistics.median(h for h, _ in hops)
            hop_bytes = int(statistics.median(n for _, n in hops))
        else:
            latency, hop_bytes = 0.0, 0
        layers = _layer_costs(raw, stages)
        slots = sorted(set(build.targets.of.values()),
                       key=lambda x: min(g for g, y in build.targets.of.items() if y == x))
        hosts = tuple(_host(str(build.targets.addresses.get(x, x))) for x in slots)
        workers = len(slots) or 1
        return cls(stages=tuple(stages), workers=workers, microbatches=build.options.microbatches,
                   hop_latency=float(latency), hop_bytes=hop_bytes, hop_samples=len(hops),
                   bandwidth=bandwidth, layers=tuple(layers), schedules=tuple(names),
                   edges=tuple((s, d, n) for (s, d), n in sorted(ebytes.items())),
                   step_overhead=statistics.median(overheads) if overheads else 0.0,
                   contention=c, hosts=hosts)

    # ------------------------------------------------------------------ pictures of it

    def _rows(self) -> list[list[str]]:
        rows = []
        for s in self.stages:
            rows.append([str(s.stage), s.worker, *(f"{s.cost(k) * 1e3:.2f}" for k in KINDS),
                         _bytes(s.send_forward), _bytes(s.send_backward),
                         _bytes(s.activation_bytes), _bytes(s.param_bytes),
                         str(len(s.layers))])
        return rows

    _HEAD = ["stage", "worker", "F ms", "B ms", "I ms", "W ms", "sends fwd", "sends bwd",
             "activations", "params", "layers"]

    def _title(self) -> str:
        bw = f"{self.bandwidth / 1e9:.2f} GB/s" if self.bandwidth else "not measured"
        return (f"Profile: {self.num_stages} stages on {self.workers} workers, "
                f"{self.microbatches} microbatches ({', '.join(self.schedules)}); hop "
                f"{self.hop_latency * 1e3:.2f} ms ({_bytes(self.hop_bytes)}, "
                f"{self.hop_samples} samples), bandwidth {bw}, step overhead "
                f"{self.step_overhead * 1e3:.0f} ms, contention {self.contention:.2f}")

    def __repr__(self) -> str:
        rows = [self._HEAD, *self._rows()]
        widths = [max(len(r[c]) for r in rows) for c in range(len(self._HEAD))]
        lines = ["  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in rows]
        return "\n".join([self._title(), *lines])

    def _repr_html_(self) -> str:
        return html_table(self._title(), self._HEAD, self._rows())


def html_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A titled HTML table (what a Profile or Prediction shows in Jupyter)."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>"
                   for r in rows)
    return (f"<p>{html.escape(title)}</p><table><thead><tr>{cells}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _host(address: str) -> str:
    """The host part of a worker address (the address itself where it has none)."""
    try:
        return str(get_address_host(address))
    except (ValueError, TypeError):
        return address


def _summary(names: Sequence[str]) -> str:
    out, last, n = [], None, 0
    for x in [*names, None]:
        if x == last:
            n += 1
            continue
        if last is not None:
            out.append(last if n == 1 else f"{last} x{n}")
        last, n = x, 1
    text = ", ".join(out)
    return text if len(text) < 80 else text[:77] + "..."


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


# ------------------------------------------------------------------- facts of the model

def _edge_bytes(trace: Trace) -> dict[tuple[int, int], int]:
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
            out[(src.stage, n.stage)] += _nbytes(x.aval)
            if x.requires_grad:
                out[(n.stage, src.stage)] += _nbytes(x.aval)
    return dict(out)


def _stage_facts(trace: Trace) -> list[dict[str, Any]]:
    """Per stage (0..S-1): bytes it sends forward and back, activation bytes per live
    microbatch, parameter bytes, and the names of its layer calls."""
    stages = sorted({n.stage for n in trace.nodes if n.kind == "call" and n.stage is not None})
    if not stages:
        return []
    count = max(stages) + 1
    facts = [{"send_forward": 0, "send_backward": 0, "activation_bytes": 0, "param_bytes": 0,
              "layers": []} for _ in range(count)]
    for (src, dst), n in _edge_bytes(trace).items():
        facts[src]["send_forward" if dst > src else "send_backward"] += n
    kept: list[set[tuple[int, int]]] = [set() for _ in range(count)]
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None:
            continue
        facts[n.stage]["layers"].append(n.name)
        for _, x in n.traced_inputs:
            if trace.nodes[x.node].kind != "param" and (x.node, x.leaf) not in kept[n.stage]:
                kept[n.stage].add((x.node, x.leaf))
                facts[n.stage]["activation_bytes"] += _nbytes(x.aval)
        for leaf, aval in enumerate(n.out_avals):
            if (n.index, leaf) not in kept[n.stage]:
                kept[n.stage].add((n.index, leaf))
                facts[n.stage]["activation_bytes"] += _nbytes(aval)
    for node, stage in home_stages(trace).items():
        if stage is not None and trace.nodes[node].kind == "param":
            facts[stage]["param_bytes"] += _nbytes(trace.nodes[node].out_avals[0])
    return facts


def _layer_costs(trace: Trace, stages: Sequence[StageProfile]) -> list[LayerCost]:
    """Each call node's share of its stage's measured F + backward time, in proportion to
    XLA's cost estimate (equal shares where the estimates are all zero)."""
    calls = [n for n in trace.nodes if n.kind == "call"]
    est = node_costs(trace) if calls else []
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for n, e in zip(calls, est):
        total[n.stage] += e
        count[n.stage] += 1
    by_stage = {s.stage: s for s in stages}
    out = []
    for n, e in zip(calls, est):
        s = by_stage.get(n.stage)
        t = (s.f + max(s.b, s.i + s.w)) if s is not None else 0.0
        share = e / total[n.stage] if total[n.stage] > 0 else 1.0 / count[n.stage]
        out.append(LayerCost(n.name, -1 if n.stage is None else int(n.stage), t * share,
                             float(e)))
    return out


# ---------------------------------------------------------------- reading a recording

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


# ------------------------------------------------------------------ measuring a cluster

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


def _default_schedules(num_stages: int, workers: int, m: int) -> tuple[Schedule, ...]:
    """A full-backward and a split-backward schedule that lay `num_stages` stages out on
    `workers` workers (1F1B + ZB-H1 for one stage per worker; interleaved (or looped
    BFS when m is not a multiple of the workers) + interleaved-zb for several)."""
    if num_stages <= workers:
        return get_schedule("1f1b"), get_schedule("zb-h1")
    if num_stages % workers:
        raise ArgumentError(
            f"dd.profile: {num_stages} stages do not lay out on {workers} workers (no "
            f"built-in schedule puts {num_stages / workers:.2f} stages on each); fix: make "
            f"the stage count a multiple of the workers, or pass schedules=")
    v = num_stages // workers
    full = Interleaved(v) if m % workers == 0 else LoopedBFS(v)
    return full, InterleavedZeroBubble(v)


def profile(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
            *, microbatches: int = 8, schedules: Iterable[Any] | None = None,
            client: Any = None, stages: Any = None, placement: Mapping[int, Any] | None = None,
            batch_argnums: Sequence[int] | None = None, batch_axis: int = 0,
            warmup: int = 1, steps: int = 1, bandwidth: bool = True,
            contention: float | None = None) -> Callable[..., Profile]:
    """Measure `fn` (a loss function, as for `dd.value_and_grad`) on a cluster:
    ``prof = dd.profile(loss_fn, microbatches=8, stages=2)(params, x, t)``.

    Runs, for each of `schedules` (default: a full-backward and a split-backward one
    for the model's layout: "1f1b" and "zb-h1" for one stage per worker), `warmup`
    steps (compiling) and then `steps` recorded steps (`dd.record`), and returns the
    `Profile` of those: per stage the median F, B, I, W seconds, the bytes sent to the
    next and previous stage, the hop latency between workers measured in the step, and
    (`bandwidth=True`, two workers or more) the bandwidth between the first two
    workers. `contention` (None: fitted; 0 for workers that never share a core, e.g. one
    per GPU) says how much workers on one host slow each other (see `simulate`).
    Gradients stay on the workers. Needs a distributed client (given, or the current
    one)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= lo
               for x, lo in ((warmup, 0), (steps, 1))):
        raise ArgumentError(f"dd.profile: warmup must be an int >= 0 and steps an int >= 1, "
                            f"got warmup={warmup!r}, steps={steps!r}")
    chosen = None if schedules is None else tuple(get_schedule(s) for s in schedules)
    if chosen is not None and not chosen:
        raise ArgumentError("dd.profile: schedules is empty; fix: pass schedule names, e.g. "
                            "schedules=('1f1b', 'zb-h1'), or leave it out")

    def options(schedule: Any, fuse: bool | None = None) -> Options:
        return Options.make("dd.profile", argnums=argnums, has_aux=has_aux,
                            microbatches=microbatches, schedule=schedule,
                            batch_argnums=batch_argnums, batch_axis=batch_axis, stages=stages,
                            placement=placement, fuse=fuse)

    options("1f1b" if chosen is None else chosen[0])      # bad options fail here, at once

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Profile:
        c = client if client is not None else current_client()
        if c is None or not hasattr(c, "scheduler_info"):
            raise ArgumentError(
                "dd.profile needs a distributed client (client=, or `with "
                "client.as_current():`), got none; fix: client = distributed.Client("
                "dd.local_cluster(2)) and pass it")
        # the staged trace before fusion: the layer calls `stages=profile` balances
        raw = trace_model(fn, args, kwargs, options("1f1b", fuse=False), c).trace
        nstages = len({n.stage for n in raw.nodes if n.kind == "call" and n.stage is not None})
        scheds = chosen if chosen is not None else _default_schedules(
            nstages, len(workers_info(c)), microbatches)
        runs: list[tuple[Recording, Build]] = []
        walls: list[float] = []
        for sched in scheds:
            # forwards and backwards timed apart: with the loss's backward fused into its
            # forward (`lower`'s fuse_seeded, under 1F1B) the last stage's B would read ~0
            # and F would hold both, which predictions for other schedules cannot split
            with dask.config.set({"dagdiff.fuse-loss-backward": False}):
                b = build(fn, args, kwargs, options(sched), c)
            loss, grads = b.outputs()
            for k in range(warmup + steps):
                if k < warmup:
                    _step(c, loss, grads)
                    continue
                with record(c) as rec:
                    t0 = time.perf_counter()
                    _step(c, loss, grads)
                    walls.append(time.perf_counter() - t0)
                runs.append((rec, b))
        bw = None
        first = runs[0][1]
        addrs = [first.targets.addresses.get(first.targets.of[s], first.targets.of[s])
                 for s in sorted(first.targets.of)]
        addrs = list(dict.fromkeys(str(a) for a in addrs))
        if bandwidth and len(addrs) >= 2 and all("://" in a for a in addrs[:2]):
            bw = measure_bandwidth(c, addrs[0], addrs[1])
        return Profile.from_recording(runs[0][0], first, also=runs[1:], raw_trace=raw,
                                      bandwidth=bw, walls=walls, contention=contention)

    return run


def _step(client: Any, loss: Any, grads: Any) -> None:
    """Compute one step and wait for it; the gradients stay on the workers."""
    from distributed import wait

    futures = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
    with client.as_current():
        wait(futures)
    errors = [f.exception() for f in futures if f.status == "error"]
    if errors:
        raise errors[0]
    del futures
