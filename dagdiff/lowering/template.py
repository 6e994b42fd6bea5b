"""Compile once, run many: a direct-dispatch step's lowered graph kept as a template and
bound to each new step's token, batch and resident inputs, instead of lowered again.

A step is traced every time (so a changed model or batch shape gives a new template), but
when its structure, options, placement, workers and the settings lowering reads are those
of a step built before, the lowering (tasks, schedule order, per-worker programs, the plan
of who sends what) is the same: only the Dask keys (the token names one computation),
the batch values, the resident parameters' Futures and the step's priority base differ.
`bind` makes exactly those, so a bound step has the keys a fresh build would give it.

The programs' own action keys keep the template's token: they name values inside one run
(messages carry the run id, a fresh nonce per submission: a `RunNonce` the scheduler
stamps), never Dask tasks.

The cache holds `TEMPLATE_CACHE_SIZE` templates per process (least recently used out);
a template holds no batch value and no resident parameter, only keys and the programs
(the model's array constants, and parameters with ``resident=False``, are part of it).
Its key covers everything the graph depends on besides the bound parts, so nothing has to
invalidate it: a worker replaced (new addresses), other options or config give another
key. Dask config ``dagdiff.step-templates: false`` turns templates off.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Hashable, Mapping

import dask
import jax
from dask.highlevelgraph import HighLevelGraph

from ..core.tracer import Trace
from ..runtime.direct import DirectGraph, Program, RunNonce, new_nonce, next_base, run_program
from ..runtime.tasks import snapshot
from ..runtime.taskspec import DataNode, Task, TaskRef
from .graph import OutKey, direct_layer
from .lower import trace_token


__all__ = ["StepTemplate", "template_key", "sharing", "lookup", "store", "enabled", "clear",
           "stats",
           "TEMPLATE_CACHE_SIZE"]

TEMPLATE_CACHE_SIZE = 64
_CACHE: "collections.OrderedDict[str, StepTemplate]" = collections.OrderedDict()
_LOCK = threading.Lock()
_STATS = {"lowered": 0, "bound": 0}


def stats() -> dict[str, int]:
    """How many steps this process lowered into a new template and how many it bound
    to an existing one (and how many templates it holds)."""
    with _LOCK:
        return {**_STATS, "templates": len(_CACHE)}


def enabled() -> bool:
    """Dask config ``dagdiff.step-templates`` (default True)."""
    return bool(dask.config.get("dagdiff.step-templates", True))


def template_key(trace: Trace, resident: Mapping[int, Any], *parts: Any) -> str:
    """What a step's lowering depends on besides its token, batch values and resident
    Futures: the trace's structure and avals, the values of every other input and array
    constant, which inputs are resident (and which leaf of their Future each reads), and
    `parts` (options, dispatch mode, workers, the settings lowering reads)."""
    return trace_token(trace, parts, bound={n: leaf for n, (_, leaf) in resident.items()})


def sharing(refs: Mapping[Hashable, str]) -> tuple[tuple[Hashable, ...], ...]:
    """Which slots of `refs` (slot -> Future key) name the same Future: part of a template
    key, since a template binds one Future per distinct key it was made with."""
    groups: dict[str, list[Hashable]] = {}
    for slot, key in refs.items():
        groups.setdefault(key, []).append(slot)
    return tuple(sorted(tuple(sorted(g, key=repr)) for g in groups.values() if len(g) > 1))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a template's graph held a bound value (a batch array, or its shard)."""

    slot: Hashable


@dataclasses.dataclass(frozen=True)
class StepTemplate:
    """A lowered direct-dispatch step, with its token, input values and referenced
    Futures as holes to fill (`bind`)."""

    token: str
    name_prefix: str
    dsk: Mapping[str, Any]                   # keys with `token`; bound values are `_Slot`
    priority: Mapping[str, int]              # per key, relative to `base` where in `relative`
    relative: frozenset[str]
    base: int
    where: Mapping[str, str]
    slots: bool
    refs: Mapping[str, Hashable]             # a referenced Future's key -> its slot
    keys: Any                                # the outputs' pytree, `OutKey` leaves

    @classmethod
    def capture(cls, token: str, name: str, plan: DirectGraph, priority: Mapping[str, int],
                where: Mapping[str, str], slots: bool, inputs: Mapping[str, Hashable],
                refs: Mapping[str, Hashable], keys: Any) -> "StepTemplate | None":
        """The template of a step just built with `token` (`plan`: its rewritten graph).
        `inputs`: the keys of the data nodes that hold bound values (-> their slot);
        `refs`: the keys of referenced Futures that are bound (-> their slot). None when
        an input is not where a template can bind it (then the step is not kept)."""
        dsk: dict[str, Any] = {}
        seen: set[str] = set()
        # the Futures a step reads are held as their keys: a template kept in the cache
        # must not keep the parameters of the step it was made from on the workers
        held = {key: TaskRef(key) for key in refs}
        for k, t in plan.dsk.items():
            if isinstance(t, DataNode) and k in inputs:
                dsk[k] = _Slot(inputs[k])
                seen.add(k)
            elif isinstance(t, Task) and t.func is run_program:
                prog: Program = t.args[0]
                if held:
                    prog = dataclasses.replace(prog, actions=tuple(
                        dataclasses.replace(a, task=a.task.substitute(held))
                        for a in prog.actions))
                prog = dataclasses.replace(prog, shared=True)     # pickled once per body
                args = []
                for s, a in zip(prog.statics, t.args[2:]):
                    if s in inputs:
                        args.append(_Slot(inputs[s]))
                        seen.add(s)
                    elif isinstance(a, TaskRef) and type(a) is not TaskRef:
                        args.append(TaskRef(a.key))          # a Future: its key only
                    else:
                        args.append(a)
                dsk[k] = Task(k, run_program, prog, t.args[1], *args)
            elif isinstance(t, Task) and held:
                dsk[k] = t.substitute(held)
            else:
                dsk[k] = t
        if seen != set(inputs):
            return None
        return cls(token, name, dsk, dict(priority), frozenset(plan.priority), plan.base,
                   dict(where), slots, dict(refs), keys)

    def bind(self, token: str, values: Mapping[Hashable, Any], refs: Mapping[Hashable, Any],
             keys: Mapping[str, str] | None = None) -> tuple[HighLevelGraph, Any]:
        """The step's graph and output keys for `token`, with `values` (slot -> value) and
        `refs` (slot -> Future, or its key) in place of the template's; `keys`: template
        keys renamed otherwise than by token (e.g. a key naming the step's number). The
        graph holds the Futures it is given, so they live as long as the step does."""
        old, new = self.token, token

        def rename(k: str) -> str:
            return k.replace(old, new).replace(old[:12], new[:12])

        subs: dict[str, Any] = {k: rename(k) for k in self.dsk}
        held: dict[str, TaskRef] = {}           # a template's Future key -> this step's
        for key, slot in self.refs.items():
            ref = refs[slot]
            subs[key] = str(getattr(ref, "key", ref))
            held[key] = ref if isinstance(ref, TaskRef) else TaskRef(subs[key])
        subs.update(keys or {})
        deps = {**subs, **held}
        base = next_base()
        nonce = RunNonce(new_nonce())           # the step's run id, stamped per submission
        dsk: dict[str, Any] = {}
        for k, t in self.dsk.items():
            k1 = subs[k]
            if isinstance(t, _Slot):
                dsk[k1] = DataNode(k1, snapshot(values[t.slot]))
            elif isinstance(t, Task) and t.func is run_program:
                prog: Program = t.args[0]
                prog = dataclasses.replace(prog, key=k1, step=new, origin=prog.origin or old)
                args = [snapshot(values[a.slot]) if isinstance(a, _Slot)
                        else (held[a.key] if isinstance(a, TaskRef) and a.key in held else
                              TaskRef(subs.get(a.key, a.key)) if isinstance(a, TaskRef) else a)
                        for a in t.args[2:]]
                dsk[k1] = Task(k1, run_program, prog, nonce, *args)
            elif isinstance(t, Task):
                dsk[k1] = t.substitute(deps, key=k1)
            else:
                dsk[k1] = t
        priority = {subs.get(k, k): (v - self.base + base if k in self.relative else v)
                    for k, v in self.priority.items()}
        where = {subs.get(k, k): w for k, w in self.where.items()}
        graph = direct_layer(f"{self.name_prefix}-{new}", dsk, priority, where, self.slots)
        out = jax.tree_util.tree_map(
            lambda k: OutKey(subs.get(k, rename(k))) if isinstance(k, OutKey) else k,
            self.keys, is_leaf=lambda x: x is None)
        return graph, out


def lookup(key: str) -> StepTemplate | None:
    """The template stored under `key` (None: lower the step and `store` it)."""
    with _LOCK:
        tpl = _CACHE.get(key)
        if tpl is not None:
            _CACHE.move_to_end(key)
            _STATS["bound"] += 1
        return tpl


def store(key: str, tpl: StepTemplate) -> None:
    """Keep `tpl` under `key` (the least recently used template goes beyond the bound)."""
    with _LOCK:
        _STATS["lowered"] += 1
        _CACHE[key] = tpl
        _CACHE.move_to_end(key)
        while len(_CACHE) > TEMPLATE_CACHE_SIZE:
            _CACHE.popitem(last=False)


def clear() -> None:
    """Forget every template (the next step of each kind is lowered again)."""
    with _LOCK:
        _CACHE.clear()
        _STATS.update(lowered=0, bound=0)
