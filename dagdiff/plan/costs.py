"""`Profile`: what `dd.profile` measured of a pipeline - per stage F, B, I, W times and bytes,
the hop latency and bandwidth between workers, per layer call its cost - the cost model
of `dd.predict` and of ``stages=profile``. Its per stage and per layer records and the
way they are shown: `stage_costs`."""
from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..build import Build
from ..core.auto import node_costs
from ..core.footprint import recompute_shares, stage_footprints
from ..core.remat import policy_of
from ..core.tracer import Trace
from ..errors import ArgumentError, MicrobatchError
from ..inspect.record import Recording
from .measure import (
    KINDS,
    Segments,
    edge_bytes,
    fit_contention,
    hop_samples,
    overlap_segments,
    stage_actions,
    stage_facts,
    work,
)
from .stage_costs import LayerCost, StageProfile, fmt_bytes, host_of, html_table


__all__ = ["KINDS", "StageProfile", "LayerCost", "Profile", "html_table", "fmt_bytes", "host_of"]

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
    batch_rows: int = 0         # the profiled batch's size along its batch axis (0: unknown)

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
        if self.batch_rows and self.batch_rows % microbatches:
            fits = [m for m in range(1, min(self.batch_rows, 4 * self.microbatches) + 1)
                    if self.batch_rows % m == 0][-4:]
            raise MicrobatchError(
                f"the profiled batch of {self.batch_rows} rows does not split into "
                f"{microbatches} equal microbatches (a step would refuse it); counts that "
                f"divide it: {fits}")
        return self.microbatches / microbatches

    def stage_costs(self, microbatches: int | None = None, remat: Any = "none"
                    ) -> dict[int, dict[str, float]]:
        """Per global stage, seconds of one F, B, I and W action at `microbatches`
        (default: the profiled count), each stage's backward with what its policy in
        `remat` recomputes: what `simulate(stage_costs=...)` takes."""
        k = self.scale(microbatches)
        return {s.stage: {kind: s.cost(kind, policy_of(remat, s.stage)) * k for kind in KINDS}
                for s in self.stages}

    @property
    def peak_memory(self) -> dict[int, int]:
        """Per stage: the most bytes its worker held in the profiled steps (measured)."""
        return {s.stage: s.peak_memory for s in self.stages}

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


    # ------------------------------------------------------------------ pictures of it

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
        facts = stage_facts(model.trace)
        footprints = stage_footprints(model.trace)
        shares = recompute_shares(model.trace)
        peaks: dict[str, int] = {}
        for rec, _ in runs:
            for w, n in rec.peak_memory().items():
                peaks[w] = max(peaks.get(w, 0), n)
        nstages = len(facts)
        if not nstages:
            raise ArgumentError("Profile.from_recording: the model has no staged layers; fix: "
                                "stage it (dd.stage, stage=, or stages='auto'/an int)")
        samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        hops: list[tuple[float, int]] = []
        overheads: list[float] = []
        ebytes = edge_bytes(model.trace)
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
            segments.append(overlap_segments(acts, host_of))
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
        raw_facts = stage_facts(raw)       # per layer: the values a live microbatch keeps
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
                samples=len(samples[("F", g)]),
                kept=footprints[g].kept if g in footprints else (),
                stash=footprints[g].stash if g in footprints else (),
                input_bytes=footprints[g].inputs if g in footprints else 0,
                received_bytes=footprints[g].received if g in footprints else 0,
                returned_bytes=footprints[g].returned if g in footprints else 0,
                fused_stash=footprints[g].fused_stash if g in footprints else (),
                recompute=(("full", 1.0), *sorted(shares.get(g, {}).items())),
                peak_memory=peaks.get(str(build.targets.address(g)), 0)))
        if hops:
            latency = statistics.median(h for h, _ in hops)
            hop_bytes = int(statistics.median(n for _, n in hops))
        else:
            latency, hop_bytes = 0.0, 0
        layers = _layer_costs(raw, stages)
        slots = sorted(set(build.targets.of.values()),
                       key=lambda x: min(g for g, y in build.targets.of.items() if y == x))
        if not hops and len(slots) > 1:
            warnings.warn(
                "dd.profile: no hop between workers could be measured in this profile (no "
                "action was seen waiting for another worker's value: the workers' clocks, "
                "as corrected by distributed, disagree by more than a hop), so its "
                "hop_latency is 0 and dd.predict / dd.best_schedule take hops as free; "
                "profile again (more steps=), or set the hop yourself: "
                "dataclasses.replace(profile, hop_latency=seconds)", RuntimeWarning,
                stacklevel=3)
        hosts = tuple(host_of(str(build.targets.addresses.get(x, x))) for x in slots)
        workers = len(slots) or 1
        return cls(stages=tuple(stages), workers=workers, microbatches=build.options.microbatches,
                   hop_latency=float(latency), hop_bytes=hop_bytes, hop_samples=len(hops),
                   bandwidth=bandwidth, layers=tuple(layers), schedules=tuple(names),
                   edges=tuple((s, d, n) for (s, d), n in sorted(ebytes.items())),
                   step_overhead=statistics.median(overheads) if overheads else 0.0,
                   contention=c, hosts=hosts,
                   batch_rows=_batch_rows(model.batch.values(), build.options.batch_axis))

    def _rows(self) -> list[list[str]]:
        rows = []
        for s in self.stages:
            rows.append([str(s.stage), s.worker, *(f"{s.cost(k) * 1e3:.2f}" for k in KINDS),
                         fmt_bytes(s.send_forward), fmt_bytes(s.send_backward),
                         fmt_bytes(s.activation_bytes), fmt_bytes(s.param_bytes),
                         str(len(s.layers))])
        return rows

    _HEAD = ["stage", "worker", "F ms", "B ms", "I ms", "W ms", "sends fwd", "sends bwd",
             "activations", "params", "layers"]

    def _title(self) -> str:
        bw = f"{self.bandwidth / 1e9:.2f} GB/s" if self.bandwidth else "not measured"
        return (f"Profile: {self.num_stages} stages on {self.workers} workers, "
                f"{self.microbatches} microbatches ({', '.join(self.schedules)}); hop "
                f"{self.hop_latency * 1e3:.2f} ms ({fmt_bytes(self.hop_bytes)}, "
                f"{self.hop_samples} samples), bandwidth {bw}, step overhead "
                f"{self.step_overhead * 1e3:.0f} ms, contention {self.contention:.2f}")

    def __repr__(self) -> str:
        rows = [self._HEAD, *self._rows()]
        widths = [max(len(r[c]) for r in rows) for c in range(len(self._HEAD))]
        lines = ["  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in rows]
        return "\n".join([self._title(), *lines])

    def _repr_html_(self) -> str:
        return html_table(self._title(), self._HEAD, self._rows())


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


def _batch_rows(values: Any, axis: int) -> int:
    """The batch's size along `axis` (0 when its arrays disagree or there is none)."""
    sizes = {np.shape(v)[axis] for v in values
             if np.ndim(v) > (axis if axis >= 0 else -axis - 1)}
    return int(sizes.pop()) if len(sizes) == 1 else 0
