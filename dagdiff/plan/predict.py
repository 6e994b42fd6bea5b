"""`dd.predict` and `dd.best_schedule`: a schedule's makespan, bubble and memory per worker
from a measured `Profile` (the pure simulator on its costs), and the picture of a
prediction above the measured timeline."""
from __future__ import annotations

import inspect as _inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import dask
from dask.utils import parse_bytes

from ..core.remat import POLICIES, check_remat, check_stages, policy_of
from ..errors import ArgumentError, MicrobatchError, ScheduleError
from ..extras import require
from ..inspect.record import PHASE_COLORS, Recording
from ..schedules import SCHEDULES, Schedule, get_schedule, simulate
from ..schedules.memory import MemoryPeak, back_to_back, memory_peaks
from .costs import Profile, fmt_bytes, html_table


__all__ = ["Prediction", "predict", "best_schedule", "timeline"]


@dataclass(frozen=True)
class Prediction:
    """What `predict` expects of one schedule on one profiled model and cluster.

    ``makespan`` (s, first action to last), ``bubble_fraction`` (1 - busy / (p x
    makespan)), per worker ``busy`` seconds, ``peak_live`` forward states alive at once
    (`Schedule.peak_live`), ``activation_bytes`` at that peak (the bytes of the live
    microbatches keep then, under their stages' policies), ``param_bytes`` (its stages'
    parameters), ``memory``: the most bytes it holds at any point of the step
    (parameters, live microbatches, weight gradients and their sums, worked out over the
    schedule's order by `dagdiff.schedules.memory`), ``peak_at``: the action where that
    is. ``remat``: the policy of each stage it assumes ({stage: "none" | "selective" |
    "full"}; `dd.value_and_grad(..., remat=pred.remat)` runs it).
    ``memory_between_tasks``: the same without what exists only inside one call (a
    fused forward and backward's residuals), which is what `dd.record` measures where
    no allocator reports its peak (CPU). ``comm``: mean seconds
    of one cross-worker hop, ``hops``: how many a step has; ``layout``: per worker its
    global stages; ``spans``: per worker (action, start, end), as `simulate` gives them;
    ``overhead``: the profile's step overhead (see `step_time`)."""

    schedule: str
    virtual_stages: int
    workers: int
    microbatches: int
    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_live: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    memory: tuple[int, ...]
    comm: float
    hops: int
    layout: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[tuple[str, float, float], ...], ...]
    overhead: float = 0.0
    remat: dict[int, str] = field(default_factory=dict)
    peak_at: tuple[str, ...] = ()
    memory_between_tasks: tuple[int, ...] = ()

    @property
    def step_time(self) -> float:
        """Predicted whole step (submit to result): `makespan` + the profile's measured
        step overhead (submitting, starting the programs, collecting outputs)."""
        return self.makespan + self.overhead

    @property
    def peak_memory(self) -> int:
        """The largest `memory` of any worker (bytes)."""
        return max(self.memory) if self.memory else 0

    def timeline(self, recording: Recording | None = None, path: str | None = None,
                 title: str | None = None, width: float = 12.0) -> Any:
        """This prediction's timeline, above `recording`'s (a `dd.record` of the same
        schedule) when given, on one time axis; see `timeline`."""
        return timeline(self, recording, path=path, title=title, width=width)

    def _title(self) -> str:
        v = f" (v={self.virtual_stages})" if self.virtual_stages > 1 else ""
        policies = set(self.remat.values())
        if policies - {"none"}:
            v += (f", remat {policies.pop()}" if len(policies) == 1 else
                  ", remat " + ",".join(f"{g}:{r}" for g, r in sorted(self.remat.items())))
        return (f"{self.schedule}{v} on {self.workers} workers, m={self.microbatches}: "
                f"makespan {self.makespan * 1e3:.1f} ms, bubble {self.bubble_fraction:.1%}, "
                f"{self.hops} hops of {self.comm * 1e3:.2f} ms")

    def _rows(self) -> list[list[str]]:
        return [[str(w), ",".join(map(str, self.layout[w])), f"{self.busy[w] * 1e3:.1f}",
                 str(self.peak_live[w]), fmt_bytes(self.activation_bytes[w]),
                 fmt_bytes(self.param_bytes[w]), fmt_bytes(self.memory[w])]
                for w in range(self.workers)]

    _HEAD = ["worker", "stages", "busy ms", "peak live", "activations", "params", "memory"]

    def __repr__(self) -> str:
        rows = [self._HEAD, *self._rows()]
        widths = [max(len(r[c]) for r in rows) for c in range(len(self._HEAD))]
        return "\n".join([f"Prediction: {self._title()}",
                          *("  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in rows)])

    def _repr_html_(self) -> str:
        return html_table(f"Prediction: {self._title()}", self._HEAD, self._rows())


def _check_profile(profile: Any, where: str) -> Profile:
    if not isinstance(profile, Profile):
        raise ArgumentError(f"{where} takes a dd.Profile, got {type(profile).__name__} "
                            f"{profile!r:.60}; fix: prof = dd.profile(loss_fn, microbatches=m)"
                            "(*args) on a cluster, then pass prof")
    return profile


def _fit(sched: Schedule, profile: Profile, workers: int | None, where: str) -> int:
    """The worker count p for `sched` on `profile` (p x v = the profile's stages)."""
    p = profile.workers if workers is None else workers
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ArgumentError(f"{where}: workers must be a positive int, got {p!r}")
    v = sched.virtual_stages
    if p * v != profile.num_stages:
        fits = (f"workers={profile.num_stages // v}" if profile.num_stages % v == 0
                else f"a model of {p * v} stages")
        raise ScheduleError(
            f"{where}: the {sched.name!r} schedule on {p} workers lays out {p * v} stages "
            f"({v} per worker), but the profile has {profile.num_stages} stages (measured on "
            f"{profile.workers} workers); fix: pass {fits}, or profile a model of {p * v} "
            f"stages (dd.profile(fn, stages={p * v}, ...))")
    return p


def predict(schedule: str | Schedule, profile: Profile, microbatches: int | None = None, *,
            workers: int | None = None, remat: Any = None) -> Prediction:
    """Predict one step of `schedule` with `microbatches` (default: the profiled count) on
    the profiled model and cluster: `simulate` on the profile's per-stage F/B/I/W times
    and per-edge hop times (latency, plus bytes over the bandwidth where measured),
    scaled to the microbatch size (the same batch cut into `microbatches` parts), and
    memory per worker from the schedule's order; workers on one host slow each other
    down as the profile's fitted ``contention`` says. `workers` defaults to the profile's; the
    schedule must lay out exactly the profile's stages (p x virtual stages), else
    ScheduleError. `remat` ("none", "selective", "full" or {stage: policy}, as
    `dd.value_and_grad` takes it): each stage keeps what its policy keeps, and its
    backward runs again what the policy recomputes."""
    prof = _check_profile(profile, "dd.predict")
    sched = get_schedule(schedule)
    m = prof.microbatches if microbatches is None else microbatches
    p = _fit(sched, prof, workers, "dd.predict")
    sched.validate(p, m)
    policy = check_remat("dd.predict", remat)
    check_stages("dd.predict", policy, {s.stage for s in prof.stages})
    per_stage = {s.stage: policy_of(policy, s.stage) for s in prof.stages}
    edges = prof.edge_comm(m)
    sim = simulate(sched, p, m, stage_costs=prof.stage_costs(m, policy), edge_comm=edges,
                   contention=prof.contention, hosts=_hosts(prof, p))
    layout = sched.checked_layout(p)
    params = [sum(prof.stages[g].param_bytes for g in stages) for stages in layout]
    peaks = _memory(prof, sched, p, m, per_stage)
    between = _memory(prof, sched, p, m, per_stage, inside_calls=False)
    worker_of = {g: w for w, stages in enumerate(layout) for g in stages}
    cross = [edges[(g - 1, g)] for g in range(1, prof.num_stages)
             if worker_of[g - 1] != worker_of[g]]
    cross += [edges[(g, g - 1)] for g in range(1, prof.num_stages)
              if worker_of[g - 1] != worker_of[g]]
    return Prediction(
        schedule=sched.name, virtual_stages=sched.virtual_stages, workers=p, microbatches=m,
        makespan=sim.makespan, bubble_fraction=sim.bubble_fraction, busy=sim.busy,
        peak_live=tuple(sched.peak_live(p, m)),
        activation_bytes=tuple(pk.activations for pk in peaks),
        param_bytes=tuple(params), memory=tuple(pk.bytes for pk in peaks),
        comm=sum(cross) / len(cross) if cross else 0.0, hops=len(cross) * m,
        layout=tuple(tuple(s) for s in layout), spans=sim.spans, overhead=prof.step_overhead,
        remat=per_stage, peak_at=tuple(pk.at for pk in peaks),
        memory_between_tasks=tuple(pk.bytes for pk in between))


def _memory(prof: Profile, sched: Schedule, p: int, m: int, remat: dict[int, str],
            inside_calls: bool = True) -> list[MemoryPeak]:
    """Per worker: the step's predicted high point (`dagdiff.schedules.memory`), with
    the loss's stage (the last) running a forward and its backward as one where the
    schedule puts them back to back, as a step does."""
    scale = prof.scale(m)
    kept = {s.stage: s.kept_by(remat.get(s.stage, "none")) * scale for s in prof.stages}
    params = {s.stage: s.param_bytes for s in prof.stages}
    last = prof.num_stages - 1
    # the loss's call runs its backward with its forward unless it recomputes (`lower`)
    fused = ({(g, mb) for g, mb in back_to_back(sched, p, m) if g == last}
             if dask.config.get("dagdiff.fuse-loss-backward", True)
             and remat.get(last, "none") != "full" else set())
    stash = {s.stage: s.stash_by(remat.get(s.stage, "none")) * scale for s in prof.stages}
    whole = {s.stage: s.input_bytes * scale * m for s in prof.stages}
    recv = {s.stage: s.received_bytes * scale for s in prof.stages}
    back = {s.stage: s.returned_bytes * scale for s in prof.stages}
    carried = {s.stage: None if (c := s.fused_stash_by(remat.get(s.stage, "none"))) is None
               else c * scale for s in prof.stages}
    return memory_peaks(sched, p, m, params, kept, fused, stash, inside_calls, whole, recv,
                        back, carried, incoming={g - 1: b for g, b in back.items()},
                        arrivals=True)


def _hosts(prof: Profile, p: int) -> list[Any] | None:
    """Each of p workers' host: the profile's (by slot) when it measured p workers, one
    host when all it saw were on one, else a host per worker."""
    if len(set(prof.hosts)) <= 1:
        return None
    return list(prof.hosts) if len(prof.hosts) == p else list(range(p))


def _takes_virtual_stages(name: str) -> bool:
    return "virtual_stages" in _inspect.signature(SCHEDULES[name]).parameters


def best_schedule(profile: Profile, microbatches: int | Iterable[int] | None = None, *,
                  memory_limit: int | str | None = None, workers: int | None = None,
                  schedules: Sequence[str] | None = None, remat: Any = "auto"
                  ) -> list[tuple[str, int, Prediction]]:
    """Rank schedules for the profiled model and cluster: every built-in schedule (or
    those named in `schedules`) whose layout fits the profile's stages on `workers`
    (default: the profile's; schedules with virtual stages get as many as the stages
    need), with each count in `microbatches` (default: the profiled one) that the
    schedule accepts, whose predicted `memory` stays within `memory_limit` (bytes per
    worker, an int or a string such as "2GB") on every worker. Returns (schedule name,
    microbatches, Prediction), shortest predicted makespan first (less memory first on
    ties); raises ArgumentError when nothing fits, saying why.

    ``remat="auto"`` (the default) also chooses a recomputation policy per stage where
    a schedule does not fit without one: stages recompute one step at a time ("none"
    -> "selective" -> "full"), each time on the stage that frees the most bytes on the
    worker furthest over the limit per second it adds, until every worker fits; the
    Prediction's ``remat`` says what it assumes. A policy (or {stage: policy}) instead
    ranks under that policy only."""
    prof = _check_profile(profile, "dd.best_schedule")
    if remat != "auto":
        check_remat("dd.best_schedule", remat)
    if isinstance(microbatches, numbers.Integral):     # an int, or NumPy's
        microbatches = int(microbatches)
    try:
        ms = ((prof.microbatches,) if microbatches is None
              else (microbatches,) if isinstance(microbatches, int)
              else tuple(int(m) if isinstance(m, numbers.Integral) and not isinstance(m, bool)
                         else m for m in microbatches))
    except TypeError:
        ms = ()
    if not ms or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in ms):
        raise ArgumentError(f"dd.best_schedule: microbatches must be a positive int or an "
                            f"iterable of them, got {microbatches!r}")
    limit = None
    if memory_limit is not None:
        try:
            limit = parse_bytes(memory_limit) if isinstance(memory_limit, str) \
                else int(memory_limit)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"dd.best_schedule: memory_limit must be bytes (an int or a "
                                f"string like '2GB'), got {memory_limit!r}") from e
        if limit <= 0:
            raise ArgumentError(f"dd.best_schedule: memory_limit must be positive bytes, got "
                                f"{memory_limit!r}")
    names = list(SCHEDULES) if schedules is None else [get_schedule(s).name for s in schedules]
    p = prof.workers if workers is None else workers
    found: list[tuple[str, int, Prediction]] = []
    why: list[str] = []
    for name in names:
        sched = get_schedule(name)
        v = prof.num_stages // p if prof.num_stages % p == 0 else 0
        if v and sched.virtual_stages != v and _takes_virtual_stages(name) and v >= 2:
            sched = get_schedule(name, virtual_stages=v)
        if sched.virtual_stages * p != prof.num_stages:
            why.append(f"{name}: lays out {sched.virtual_stages * p} stages on {p} workers")
            continue
        for m in ms:
            try:
                pred = predict(sched, prof, m, workers=p,
                               remat=None if remat == "auto" else remat)
            except ScheduleError as e:
                why.append(f"{name} m={m}: {str(e).split('; fix')[0]}")
                continue
            except MicrobatchError as e:
                why.append(f"{name} m={m}: {e}")
                continue
            if limit is not None and pred.peak_memory > limit and remat == "auto":
                pred = _fit_memory(sched, prof, m, p, limit, pred)
            if limit is not None and pred.peak_memory > limit:
                why.append(f"{name} m={m}: needs {fmt_bytes(pred.peak_memory)} > "
                           f"{fmt_bytes(limit)} on a worker" +
                           (" even with full recomputation" if remat == "auto" else ""))
                continue
            found.append((name, m, pred))
    memory = any("needs " in w for w in why)
    if not found:
        raise ArgumentError(
            f"dd.best_schedule: no schedule fits the profile ({prof.num_stages} stages, {p} "
            f"workers, memory_limit={memory_limit!r}): " + "; ".join(why[:12])
            + "; fix: " + ("raise memory_limit, " if memory else "")
            + "try other microbatch counts (ones the profiled batch splits into), or "
            "profile a model with another stage count")
    return sorted(found, key=lambda r: (r[2].makespan, r[2].peak_memory, r[1]))


def _fit_memory(sched: Schedule, prof: Profile, m: int, p: int, limit: int,
                pred: Prediction) -> Prediction:
    """The fastest prediction found that fits `limit` on every worker, stages moved up
    the policies one at a time (see `best_schedule`); `pred` (no recomputation) when
    none fits, and the lowest-memory one found."""
    policy = dict(pred.remat)
    best_fit: Prediction | None = None
    tried = [pred]
    while True:
        over = max(range(p), key=lambda w: pred.memory[w])
        options = []
        for g, current in policy.items():
            i = POLICIES_UP.index(current)
            if i + 1 == len(POLICIES_UP):
                continue
            trial = predict(sched, prof, m, workers=p,
                            remat={**policy, g: POLICIES_UP[i + 1]})
            tried.append(trial)
            freed = pred.memory[over] - trial.memory[over]
            cost = max(trial.makespan - pred.makespan, 1e-9)
            if freed > 0:
                options.append((freed / cost, freed, g, trial))
        if not options:
            break
        _, _, g, pred = max(options, key=lambda o: (o[0], o[1]))
        policy = dict(pred.remat)
        if pred.peak_memory <= limit:
            best_fit = pred
            break
    fits = [t for t in tried if t.peak_memory <= limit]
    if fits:
        return min(fits, key=lambda t: (t.makespan, t.peak_memory))
    return best_fit or min(tried, key=lambda t: t.peak_memory)


#: policies from keeping the most to keeping the least
POLICIES_UP = ("none", "selective", "full")
assert set(POLICIES_UP) == set(POLICIES)


def timeline(prediction: Prediction, recording: Recording | None = None,
             path: str | None = None, title: str | None = None, width: float = 12.0) -> Any:
    """Draw `prediction`'s per-worker timeline and, below it on the same time axis, the
    F/B/I/W actions of `recording` (a `dd.record` of that schedule, shifted so its
    first action starts at 0). Saves to `path` when given; returns the matplotlib
    Figure (needs matplotlib, the ``viz`` extra)."""
    matplotlib = require("matplotlib", "dd.Prediction.timeline")
    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    measured = []
    if recording is not None:
        measured = [t for t in recording.tasks if t.phase in ("F", "B", "I", "W")]
    panels = 2 if recording is not None else 1
    rows_m = recording.workers if recording is not None else []
    heights = [prediction.workers] + ([max(len(rows_m), 1)] if panels == 2 else [])
    fig, axes = plt.subplots(panels, 1, sharex=True, squeeze=False,
                             figsize=(width, 0.55 * sum(heights) + 1.3 * panels),
                             gridspec_kw={"height_ratios": heights})
    ax = axes[0][0]
    seen = set()
    for w, spans in enumerate(prediction.spans):
        for label, a, b in spans:
            kind = label[0]
            seen.add(kind)
            ax.broken_barh([(a, max(b - a, 1e-9))], (w - 0.4, 0.8), facecolors=PHASE_COLORS[kind],
                           edgecolor="black", linewidth=0.3)
            ax.text((a + b) / 2, w, label[1:], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(prediction.workers))
    ax.set_yticklabels([f"worker {w}" for w in range(prediction.workers)])
    ax.invert_yaxis()
    ax.set_title(title or f"predicted: {prediction._title()}", fontsize=9)
    if panels == 2:
        assert recording is not None
        ax2 = axes[1][0]
        t0 = min((t.start for t in measured), default=0.0)
        t1 = max((t.stop for t in measured), default=0.0)
        for r, wk in enumerate(rows_m):
            for t in measured:
                if t.worker != wk:
                    continue
                seen.add(t.phase)
                ax2.broken_barh([(t.start - t0, max(t.stop - t.start, 1e-9))], (r - 0.4, 0.8),
                                facecolors=PHASE_COLORS[t.phase], edgecolor="black",
                                linewidth=0.3)
                label = "" if t.microbatch is None else str(t.microbatch)
                ax2.text(t.start - t0 + (t.stop - t.start) / 2, r, label, ha="center",
                         va="center", fontsize=6)
        ax2.set_yticks(range(len(rows_m)))
        ax2.set_yticklabels([recording.worker_names.get(w, w) for w in rows_m])
        ax2.invert_yaxis()
        span = t1 - t0
        err = (prediction.makespan - span) / span if span > 0 else 0.0
        ax2.set_title(f"measured: makespan {span * 1e3:.1f} ms (predicted {err:+.1%})",
                      fontsize=9)
        ax2.set_xlabel("time (s)")
    else:
        ax.set_xlabel("time (s)")
    order = [k for k in ("F", "B", "I", "W") if k in seen]
    axes[0][0].legend(handles=[Patch(facecolor=PHASE_COLORS[k], edgecolor="black", label=k)
                               for k in order], loc="upper right", fontsize=7, ncol=len(order))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
