"""A pipeline step's predicted memory per worker, from its trace: the stages' footprints
(`dagdiff.core.footprint`) over the schedule's order (`dagdiff.schedules.memory`)."""
from __future__ import annotations

from typing import Any, Mapping

import dask
from dask.utils import format_bytes

from ..cluster.info import workers_info
from ..core.footprint import StageFootprint, stage_footprints
from ..core.remat import RematPolicy, policy_of
from ..core.tracer import Trace
from ..errors import MemoryLimitError
from ..schedules import Schedule
from ..schedules.memory import MemoryPeak, memory_peaks
from .pipeline import fused_microbatches


__all__ = ["step_memory", "loss_fused", "check_memory"]


def loss_fused(trace: Trace, schedule: Schedule, m: int, loss_stage: int | None
               ) -> set[tuple[int, int]]:
    """The (stage, microbatch) pairs whose forward runs fused with its backward: the
    loss's stage, where the schedule runs B right after F (unless
    ``dagdiff.fuse-loss-backward`` is off, or the loss's call recomputes or has
    hand-written rules: `lower` fuses neither)."""
    if loss_stage is None or not dask.config.get("dagdiff.fuse-loss-backward", True):
        return set()
    calls = [n for n in trace.nodes if n.kind == "call" and n.stage == loss_stage]
    if calls and (calls[-1].spec.remat or getattr(calls[-1].spec.layer, "custom", False)):
        return set()
    return {(g, mb) for g, mb in fused_microbatches(trace, schedule, m)
            if g == loss_stage and g is not None}


def step_memory(footprints: Mapping[int, StageFootprint], schedule: Schedule, p: int, m: int,
                remat: RematPolicy = "none", fused: set[tuple[int, int]] = frozenset(),
                scale: float = 1.0, inside_calls: bool = True,
                held: Mapping[int, float] | None = None) -> list[MemoryPeak]:
    """Per worker: the predicted `MemoryPeak` of one step of `schedule` on `p` workers
    with `m` microbatches, each stage under its policy in `remat`; `scale` multiplies
    what a microbatch keeps (a profile measured at another microbatch size);
    `inside_calls`: see `memory_peaks`; `held[g]`: more bytes stage g holds for the
    whole step (a Trainer's optimizer state)."""
    params = {g: f.params for g, f in footprints.items()}
    kept = {g: f.kept_by(policy_of(remat, g)) * scale for g, f in footprints.items()}
    stash = {g: f.stash_by(policy_of(remat, g)) * scale for g, f in footprints.items()}
    whole = {g: f.inputs * m * scale + (held or {}).get(g, 0)
             for g, f in footprints.items()}
    recv = {g: f.received * scale for g, f in footprints.items()}
    back = {g: f.returned * scale for g, f in footprints.items()}
    carried = {g: None if (c := f.fused_stash_by(policy_of(remat, g))) is None else c * scale
               for g, f in footprints.items()}
    return memory_peaks(schedule, p, m, params, kept, fused, stash, inside_calls, whole, recv,
                        back, carried, incoming={g - 1: b for g, b in back.items()},
                        arrivals=True)


def check_memory(trace: Trace, schedule: Schedule, m: int, remat: RematPolicy,
                 loss_stage: int | None, address_of: Mapping[int, str | None],
                 client: Any, held: Mapping[int, float] | None = None) -> list[MemoryPeak]:
    """Refuse a pipeline step whose predicted peak on a worker exceeds that worker's Dask
    ``memory_limit`` (`MemoryLimitError`, naming the stage, the worker and the bytes),
    before any task runs; the per-worker predictions otherwise. Workers without a
    limit are not checked. `held[g]`: what stage g holds beside the step's own values
    for the whole step (a Trainer's optimizer state)."""
    v = schedule.virtual_stages
    n = trace.num_stages
    if not n or n % v:
        return []
    p = n // v
    fps = stage_footprints(trace, policies=_used(remat, n))
    peaks = step_memory(fps, schedule, p, m, remat, loss_fused(trace, schedule, m, loss_stage),
                        held=held)
    info = workers_info(client, cached=True) if client is not None else {}
    layout = schedule.checked_layout(p)
    for w, peak in enumerate(peaks):
        stages = layout[w]
        addr = address_of.get(stages[0])
        limit = int((info.get(addr) or {}).get("memory_limit") or 0) if addr else 0
        if limit and peak.bytes > limit:
            what = ", ".join(f"stage {g}: {format_bytes(fps[g].params)} parameters, "
                             + (f"{format_bytes((held or {}).get(g, 0))} optimizer state, "
                                if (held or {}).get(g) else "") +
                             f"{format_bytes(fps[g].kept_by(policy_of(remat, g)))} per live "
                             f"microbatch" for g in stages if g in fps)
            raise MemoryLimitError(
                f"the step needs about {format_bytes(peak.bytes)} on worker {addr} (schedule "
                f"{schedule.name}, m={m}, stages {', '.join(map(str, stages))}: {what}; "
                f"{peak.live} microbatches live at {peak.at}), more than its memory_limit "
                f"of {format_bytes(limit)}; fix: remat='selective' or 'full' for stage "
                f"{stages[0]} (remat={{{stages[0]}: 'full'}}), more microbatches, a schedule "
                "that keeps fewer alive (1f1b), or dd.best_schedule(profile, memory_limit=...)")
    return peaks


def _used(remat: RematPolicy, n: int) -> tuple[str, ...]:
    return tuple(sorted({policy_of(remat, g) for g in range(n)}))
