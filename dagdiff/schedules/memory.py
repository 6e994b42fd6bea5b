"""The bytes each worker holds over a schedule's order: its peak, from per-stage sizes.

Pure arithmetic on a schedule's table (no JAX): what `dd.predict(...).memory` reports and
what a build checks against a worker's memory limit. A worker starts holding its stages'
parameters and the batch they read; then, per action, in order:

- F of stage g: its live microbatch keeps ``kept[g]`` until its backward. A forward
  fused with its backward (the loss's stage, where F and B run back to back) keeps
  instead the gradients it computed (``params[g]``, and ``returned[g]``: those of the
  activations it received, which it sends back) and the activations it received, until
  its B task hands them on; fused with a split backward's I, what its W needs instead
  of the weight gradients (``fused_stash[g]``: the values the split carries), or, where
  its backward cannot be split, every gradient as before, until W.
- B (or W) of stage g: the microbatch's weight gradients (``params[g]``) appear and its
  ``kept[g]`` goes (the pullback is dropped); a B's result also holds the cotangents it
  sends back (``returned[g]``) until the accumulation has read it. Then the accumulator
  adds the gradients to the previous sum (a new sum while the old one is still held),
  and the gradients and the old sum go.
- I (a split backward's input part) frees nothing: its W still needs the residuals, and
  it leaves ``stash[g]`` beside them (the output cotangents W reads, and what the split
  carries), held until W; its own result (``returned[g]``) is sent on.

The peak is the largest total at any of these points: where each task has its result
and its inputs are still held.

With ``arrivals``, values sent from other workers count from when they arrive, not from
when their action takes them: an activation for a later F (``received[g]``) or a
cotangent for a later backward (``incoming[g]``) that arrived before an action ended is
held beside it (a worker busy with B0 when F1's input comes holds both). When senders
end comes from the schedule run with F = 1, B = 2, I = W = 1 and a hop between workers
of `HOP` (one forward's time: `simulate`); a value arrives `HOP` after its sender ended. Measured against `dd.record`
on every built-in schedule and policy (`benchmarks/bench_memory.py --all-schedules`),
this brought the worst of 96 cells from -11% to within 8% in the two runs it was chosen
on; counting arrivals at once, or a backward's incoming cotangent while it runs,
over-counted what the samples see (+12 to +14% on some cells).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Collection, Mapping

from .base import Schedule
from .simulate import simulate


__all__ = ["MemoryPeak", "memory_peaks", "back_to_back"]


@dataclass(frozen=True)
class MemoryPeak:
    """One worker's predicted high point: ``bytes`` held, ``live`` microbatches whose
    forward state it holds then, ``activations`` (the bytes those keep), and ``at``
    the action (e.g. ``"B3 s0"``, ``"acc3 s0"`` for the accumulation after it)."""

    bytes: int
    live: int
    at: str
    activations: int = 0


def memory_peaks(schedule: Schedule, p: int, m: int, params: Mapping[int, float],
                 kept: Mapping[int, float], fused: Collection[tuple[int, int]] = (),
                 stash: Mapping[int, float] | None = None, inside_calls: bool = True,
                 held_whole: Mapping[int, float] | None = None,
                 received: Mapping[int, float] | None = None,
                 returned: Mapping[int, float] | None = None,
                 fused_stash: Mapping[int, float | None] | None = None,
                 incoming: Mapping[int, float] | None = None,
                 arrivals: bool = False) -> list[MemoryPeak]:
    """Per worker of `schedule` on `p` workers with `m` microbatches: its `MemoryPeak`.
    `params[g]` / `kept[g]`: bytes of stage g's parameters and of what one live
    microbatch keeps (`dagdiff.core.footprint`); `fused`: (stage, microbatch) pairs
    whose forward runs with its backward; `stash[g]`: what a split backward's I leaves
    for its W (the output cotangents W reads and what the split carries), held from I
    to W; `fused_stash[g]`: what a forward fused with its I carries to its W (None or
    absent: its backward does not split, the forward computes every gradient);
    `returned[g]`: the cotangents a backward of stage g computes for the activations it
    received (its result, sent back). `inside_calls=False`
    leaves out what exists only inside one call (a fused forward and backward's
    residuals): the peak as samples between tasks see it, where no allocator reports
    its own peak (CPU). `held_whole[g]`: bytes stage g holds for the whole step (its
    batch inputs); `received[g]`: the part of `kept[g]` that a microbatch brought from
    other stages, which a fused forward holds until its backward task has run;
    `incoming[g]`: the cotangents a backward of stage g receives from stage g + 1;
    `arrivals`: count values from other workers from their arrival (module docstring)."""
    layout = schedule.checked_layout(p)
    early = _early(schedule, p, m, received or {}, incoming or {}) if arrivals else None
    held_whole = held_whole or {}
    received = received or {}
    returned = returned or {}
    stash = stash or {}
    fused_stash = fused_stash or {}
    split = schedule.split_backward
    out = []
    for w, order in enumerate(schedule.table(p, m)):
        held = float(sum(params.get(g, 0) + held_whole.get(g, 0) for g in layout[w]))
        summed: set[int] = set()        # stages whose accumulator exists
        live, acts = 0, 0.0
        best = MemoryPeak(int(round(held)), 0, "start")

        def note(total: float, label: str) -> None:
            nonlocal best
            total += extra
            if total > best.bytes:
                best = MemoryPeak(int(round(total)), live, label, int(round(acts)))

        for j, a in enumerate(order):
            g = layout[w][a.chunk]
            extra = early[w][j] if early is not None else 0.0
            label = f"{a.kind}{a.microbatch} s{g}"
            pg, kg, sg = (float(params.get(g, 0)), float(kept.get(g, 0)),
                          float(stash.get(g, 0)))
            rg, recv = float(returned.get(g, 0)), float(received.get(g, 0))
            is_fused = (g, a.microbatch) in fused
            fs = fused_stash.get(g)
            ahead = is_fused and not (split and fs is not None)   # every gradient with F
            if a.kind == "F":
                live += 1
                if is_fused:                         # inside the fused call, then after
                    # the input cotangents stay on its result until its last backward
                    # task; then the weight gradients, or what its W needs to make them
                    keeps = (pg if ahead else float(fs)) + rg + recv
                    note(held + (kg if inside_calls else 0.0) + keeps, label)
                    held += keeps
                else:
                    held, acts = held + kg, acts + kg
                    note(held, label)
            elif a.kind == "I":
                if not is_fused:                     # (a fused one ran with its F)
                    held += sg                       # what W will need, beside the residuals
                    note(held + rg, label)           # and its result, being sent back
                else:
                    note(held, label)
            else:                                   # B, W: weight gradients, accumulate
                if not ahead:                       # computed now
                    held += pg
                sent = rg if a.kind == "B" and not is_fused else 0.0
                note(held + sent, label)
                if not is_fused:                    # its pullback (residuals) is let go
                    held, acts = held - kg, acts - kg
                    if a.kind == "W":
                        held -= sg
                else:                               # the inputs its fused forward kept,
                    held -= recv + (0.0 if ahead else float(fs))    # and what W read
                    if a.kind == "W":               # the input cotangents go with it
                        held -= rg
                    else:                           # B's result holds them until summed
                        sent = rg
                        held -= rg
                live -= 1
                if g in summed:                     # a new sum beside the old one
                    note(held + pg + sent, f"acc{a.microbatch} s{g}")
                    held -= pg                      # the gradients and the old sum go
                else:
                    summed.add(g)                   # the first sum is the gradients
        out.append(best)
    return out


#: how long after its sender ends a value from another worker is counted as arrived, in
#: units of a forward (module docstring)
HOP = 1.0


def _early(schedule: Schedule, p: int, m: int, received: Mapping[int, float],
           incoming: Mapping[int, float]) -> list[list[float]]:
    """Per worker, per action in its order: the bytes from other workers that arrived
    before the action ended (`HOP` after their sender ended) and that a later action of
    the worker takes (an activation for an F, a cotangent for a B or I), by the
    schedule's run with F = 1, B = 2, I = W = 1 and hops of `HOP`."""
    layout = schedule.checked_layout(p)
    table = schedule.table(p, m)
    worker_of = {g: w for w, stages in enumerate(layout) for g in stages}
    spans = simulate(schedule, p, m, comm=HOP).spans
    ends: dict[tuple[int, int, str], float] = {}
    for w, order in enumerate(table):
        for a, (_, _, end) in zip(order, spans[w]):
            ends[(layout[w][a.chunk], a.microbatch, a.kind)] = end
    back = "I" if schedule.split_backward else "B"
    out = []
    for w, order in enumerate(table):
        finish = [end for _, _, end in spans[w]]
        diff = [0.0] * (len(order) + 1)
        for j, a in enumerate(order):
            g = layout[w][a.chunk]
            if a.kind == "F" and g > 0 and worker_of[g - 1] != w:
                sent, size = ends.get((g - 1, a.microbatch, "F")), received.get(g, 0)
            elif a.kind in "BI" and worker_of.get(g + 1, w) != w:
                sent = ends.get((g + 1, a.microbatch, back))
                sent = sent if sent is not None else ends.get((g + 1, a.microbatch, "B"))
                size = incoming.get(g, 0)
            else:
                continue
            if sent is None or not size:
                continue
            k = bisect.bisect_left(finish, sent + HOP)   # the first to end after it came
            if k < j:
                diff[k] += float(size)
                diff[j] -= float(size)
        run, held = 0.0, []
        for j in range(len(order)):
            run += diff[j]
            held.append(run)
        out.append(held)
    return out


def back_to_back(schedule: Schedule, p: int, m: int) -> set[tuple[int, int]]:
    """The (global stage, microbatch) pairs whose backward (B, or a split backward's I)
    `schedule` runs right after their forward on the same worker: where the loss's
    stage can run both as one call."""
    layout = schedule.checked_layout(p)
    out: set[tuple[int, int]] = set()
    for w, acts in enumerate(schedule.table(p, m)):
        for act, nxt in zip(acts, acts[1:]):
            if act.kind == "F" and nxt.kind in "BI" and nxt.microbatch == act.microbatch \
                    and nxt.chunk == act.chunk:
                out.add((layout[w][act.chunk], act.microbatch))
    return out
