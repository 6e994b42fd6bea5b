"""Where each stage runs: worker slots, worker addresses or local JAX devices."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import jax

from ..core.stage import check_stage
from ..errors import PlacementError
from .info import seen_slots, slot_names, workers_info


__all__ = ["Targets", "resolve_targets", "annotations_for"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Targets:
    """Where stages run: kind 'slots' (worker resources), 'workers' (addresses, for clusters
    started without slot resources), 'devices' (local JAX devices) or 'none'."""

    kind: str
    of: Mapping[int, Any]                  # stage -> slot name / worker address / device index
    addresses: Mapping[Any, str] = dataclasses.field(default_factory=dict)  # slot -> address
    #: stage -> (its own slot, the live slot it runs on instead): stages whose worker is
    #: lost (restarting, or scaled away), placed on the survivors until it is back
    moved: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def target(self, stage: int | None) -> Any:
        """The slot name / worker address / device index of `stage` (None: unstaged)."""
        return None if stage is None else self.of.get(stage)

    @property
    def on_workers(self) -> bool:
        """Whether stages run on distributed workers (slots or addresses)."""
        return self.kind in ("slots", "workers")

    @property
    def slots(self) -> bool:
        """Whether stages are placed by slot resources (their workers may be replaced)."""
        return self.kind == "slots"

    def address(self, stage: int | None) -> str | None:
        """The worker address `stage` runs on now (None without a cluster, or unstaged)."""
        t = self.target(stage)
        addr = self.addresses.get(t) if self.slots else t
        return addr if isinstance(addr, str) else None

    def worker_addresses(self) -> set[str]:
        """The workers a step placed by these targets depends on: every slot's worker
        (slots), or every worker a stage runs on (addresses)."""
        if self.slots:
            return set(self.addresses.values())
        return {w for w in self.of.values() if isinstance(w, str)}

    def devices(self) -> dict[int, int] | None:
        """Stage -> local JAX device index, when stages run on this process's devices."""
        return dict(self.of) if self.kind == "devices" else None


def resolve_targets(stages: set[int], client: Any, placement: Mapping[int, Any] | None,
                    default: Mapping[int, int] | None = None) -> Targets:
    """Map each stage to its slot (with a distributed client) or local device (without).

    Stage s goes to `placement[s]` if given, else to slot/device ``default.get(s, s) mod
    n`` (`default`: a pipeline schedule's layout, see `lowering.pipeline.stage_workers`).
    With a client, the workers come from its cached list (`cluster.info.workers_info`),
    asked again when that list cannot place the stages."""
    if client is None:
        return _resolve(stages, client, placement, default, cached=False)
    try:
        return _resolve(stages, client, placement, default, cached=True)
    except PlacementError:
        return _resolve(stages, client, placement, default, cached=False)


def _resolve(stages: set[int], client: Any, placement: Mapping[int, Any] | None,
             default: Mapping[int, int] | None, cached: bool) -> Targets:
    """`resolve_targets` from the cached list of workers or (`cached` False) a fresh one."""
    default = dict(default or {})
    placement = dict(placement or {})
    for s in placement:
        check_stage(s, "a key of placement")
    unknown = sorted(set(placement) - set(stages))
    if unknown and stages:
        warnings.warn(f"placement names stage(s) {unknown} that the model does not have (its "
                      f"stages: {sorted(stages)}); those entries are ignored", stacklevel=3)
    if not stages:
        return Targets("none", {})
    if client is None:
        n = len(jax.local_devices())
        of = {}
        for s in sorted(stages):
            d = placement.get(s, default.get(s, s) % n)
            if not isinstance(d, int) or not 0 <= d < n:
                raise PlacementError(f"placement[{s}]={d!r}: this process has {n} JAX devices "
                                     f"(0..{n - 1}); give a device index")
            of[s] = d
        return Targets("devices", of)

    slots = slot_names(client, cached)
    if not slots:
        workers = sorted(workers_info(client, cached))
        if not workers:
            raise PlacementError("the distributed cluster has no workers; start some first")
        log.warning("dagdiff: workers have no slot<i> resources (start them with "
                    "`dask worker --resources slot<i>=1` or use dd.local_cluster); pinning "
                    "stages by address, which does not survive worker restarts")
        n = len(workers)
        return Targets("workers", {s: workers[placement.get(s, default.get(s, s) % n) % n]
                                   for s in stages})
    by_slot = {name: addr for addr, name in slots.items()}
    # the cluster's full set of slots, live or not: a stage keeps its own slot through a
    # loss (and goes back to it when the replacement joins)
    names = sorted(set(by_slot) | seen_slots(client), key=_slot_order)
    of = {}
    for s in sorted(stages):
        want = placement.get(s, default.get(s, s) % len(names))
        if s not in placement:
            name = names[want]
        else:
            name = f"slot{want}" if isinstance(want, int) else str(want)
        if isinstance(want, int) and not 0 <= want < len(names):
            raise PlacementError(f"placement[{s}]={want}: the cluster has {len(names)} slots "
                                 f"({', '.join(names)})")
        if name not in names:
            raise PlacementError(f"placement[{s}]={want!r}: no worker has resource {name!r}; "
                                 f"slots are {', '.join(names)}")
        of[s] = name
    return Targets("slots", *_on_survivors(of, names, by_slot))


def _slot_order(name: str) -> tuple[int, str]:
    return (int(name[4:]), "") if name[4:].isdigit() else (1 << 30, name)


def _on_survivors(of: dict[int, str], names: list[str], by_slot: Mapping[str, str]
                  ) -> tuple[dict[int, str], Mapping[str, str], dict[int, tuple[str, str]]]:
    """Stages whose slot has no worker now, placed on live slots: the first slot after
    theirs (in slot order, where a stage's copy is kept) that runs no stage, else the
    least busy one. No waiting for a replacement; `Targets.moved` says what moved."""
    live = [n for n in names if n in by_slot]
    if not live:
        raise PlacementError(
            f"no worker of the cluster's slots ({', '.join(names)}) is running; start "
            "workers (dask worker --resources slot<i>=1), or wait for their restart")
    load = {n: 0 for n in live}
    for name in of.values():
        if name in load:
            load[name] += 1
    moved: dict[int, tuple[str, str]] = {}
    for s in sorted(of):
        own = of[s]
        if own in by_slot:
            continue
        i = names.index(own)
        ring = [n for n in names[i + 1:] + names[:i] if n in by_slot]
        pick = min(ring, key=lambda n: (load[n], ring.index(n)))
        load[pick] += 1
        of[s] = pick
        moved[s] = (own, pick)
    return of, dict(by_slot), moved


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
