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
from ..runtime.plugins import MEMORY_METRIC, memory_enforced_here
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
        entry = (info.get(addr) or {}) if addr else {}
        limit = int(entry.get("memory_limit") or 0)
        if not limit:
            continue
        # where Dask enforces the limit (a worker pauses at 80%, is restarted at 95%),
        # the process's own memory counts too (the JAX runtime, compiled code: its last
        # heartbeat's size less the data Dask holds): a step over it is paused or killed
        enforced, setting = _enforced_fraction(entry, addr, client)
        base = _unmanaged(entry) if enforced else 0
        budget = int(limit * enforced) if enforced else limit
        if base + peak.bytes > budget:
            what = ", ".join(f"stage {g}: {format_bytes(fps[g].params)} parameters, "
                             + (f"{format_bytes((held or {}).get(g, 0))} optimizer state, "
                                if (held or {}).get(g) else "") +
                             f"{format_bytes(fps[g].kept_by(policy_of(remat, g)))} per live "
                             f"microbatch" for g in stages if g in fps)
            room = (f"more than the {format_bytes(max(budget - base, 0))} its memory_limit "
                    f"of {format_bytes(limit)} leaves beside the {format_bytes(base)} the "
                    f"worker process holds of its own before Dask "
                    f"{'pauses' if setting == 'pause' else 'restarts'} it at {enforced:.0%} "
                    f"(distributed.worker.memory.{setting})" if enforced
                    else f"more than its memory_limit of {format_bytes(limit)}")
            raise MemoryLimitError(
                f"the step needs about {format_bytes(peak.bytes)} on worker {addr} (schedule "
                f"{schedule.name}, m={m}, stages {', '.join(map(str, stages))}: {what}; "
                f"{peak.live} microbatches live at {peak.at}), {room}; fix: remat='selective' "
                f"or 'full' for stage {stages[0]} (remat={{{stages[0]}: 'full'}}), more "
                "microbatches, a schedule "
                "that keeps fewer alive (1f1b), or dd.best_schedule(profile, memory_limit=...)")
    return peaks


#: worker address -> what `memory_enforced_here` told, for workers whose heartbeats do
#: not tell it yet (dagdiff's plugin was installed after their last one)
_TOLD: dict[str, list[float]] = {}


def _valid(told: Any) -> bool:
    return isinstance(told, (list, tuple)) and len(told) == 2


def _enforced_fraction(entry: Mapping[str, Any], address: str,
                       client: Any) -> tuple[float, str]:
    """The share of `memory_limit` a step must stay under on the worker of `entry` (its
    scheduler identity), and the setting that gives it: where the worker pauses
    (``distributed.worker.memory.pause``: it runs no new task, the next step's programs
    wait), else where its nanny restarts it (``terminate``); (0, "") when Dask enforces
    neither. The worker tells it in its heartbeats (`plugins.memory_enforced`), or once
    when asked; where it cannot, this process's config stands in."""
    told = (entry.get("metrics") or {}).get(MEMORY_METRIC)
    if not _valid(told):
        told = _TOLD.get(address)
    if not _valid(told) and client is not None and not getattr(client, "asynchronous", False):
        try:                        # once per worker: its config does not change
            told = client.run(memory_enforced_here, workers=[address]).get(address)
        except Exception:           # noqa: BLE001 - gone meanwhile: the config below
            told = None
        if _valid(told):
            if len(_TOLD) > 4096:
                _TOLD.clear()
            _TOLD[address] = list(told)
    if not _valid(told):
        told = [dask.config.get(f"distributed.worker.memory.{name}", default)
                for name, default in (("pause", 0.8), ("terminate", 0.95))]
    for name, value in zip(("pause", "terminate"), told):
        try:
            share = float(value) if value not in (False, None) else 0.0
        except (TypeError, ValueError):
            share = 0.0
        if share > 0:
            return share, name
    return 0.0, ""


def _unmanaged(entry: Mapping[str, Any]) -> int:
    """A worker's process memory outside the data Dask holds, from its last heartbeat."""
    metrics = entry.get("metrics") or {}
    try:
        return max(int(metrics.get("memory") or 0) - int(metrics.get("managed_bytes") or 0), 0)
    except (TypeError, ValueError):
        return 0


def _used(remat: RematPolicy, n: int) -> tuple[str, ...]:
    return tuple(sorted({policy_of(remat, g) for g in range(n)}))
