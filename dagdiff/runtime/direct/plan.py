"""Which tasks of a step each worker's program runs, in which order, and who reads what (pure).

Its records are also what a program runs: `graph.rewrite` binds each `PlannedAction` to its
Dask task and each `Consumers` to its worker's address (`dataclasses.replace`), and the
worker's `run.ProgramRun` interprets them; one set of types from the plan to the run."""
from __future__ import annotations

import collections
import dataclasses
from typing import Collection, Mapping

from ...core.dag import topological
from ...errors import DirectDispatchError
from ..taskspec import Task


__all__ = ["Consumers", "PlannedAction", "ProgramPlan", "Plan", "plan_programs", "linearize"]


@dataclasses.dataclass(frozen=True)
class Consumers:
    """The consumers of a value on one other worker."""

    where: str                               # that worker (its slot, or address)
    uses: int                                # how many of its actions read the value
    leaves: frozenset[int] | None = None     # the leaves they read (None: all)
    address: str = ""                        # its Dask address (bound by `graph.rewrite`)


@dataclasses.dataclass(frozen=True)
class PlannedAction:
    """One task of a program: where its inputs come from and where its value goes, and
    once bound, the Dask task it runs (ordering-only edges dropped)."""

    key: str
    inputs: tuple[tuple[str, str], ...]      # (producer key, producer's worker)
    local: int                               # consumer actions on this worker
    remote: tuple[Consumers, ...]            # consumers on other workers
    export: bool                             # an ordinary task (an output) reads it
    task: Task | None = None                 # bound by `graph.rewrite`


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """A worker's part of one step: its actions in run order and the step's inputs
    (keys outside the programs: parameters, batch) they read."""

    where: str
    actions: tuple[PlannedAction, ...]
    statics: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every worker's program of a step (empty when no task can run in one)."""

    programs: tuple[ProgramPlan, ...]
    direct: frozenset[str]                   # the keys run inside programs


def plan_programs(deps: Mapping[str, Collection[str]], tasks: Collection[str],
                  worker_of: Mapping[str, str | None], priority: Mapping[str, int],
                  keep: Collection[str], outputs: Collection[str] = (),
                  reads: Mapping[str, Mapping[str, frozenset[int] | None]] | None = None
                  ) -> Plan:
    """Plan a step's programs.

    `deps`: every key of the graph -> its data dependencies (inputs have none); `tasks`:
    the keys that are computations (the rest are data); `worker_of`: key -> its worker
    (None: anywhere). A task runs in its worker's program unless it is in `keep` (the
    step's outputs, which stay ordinary tasks) or reads an ordinary task. `priority`
    orders the schedule's actions (higher first, see `linearize`); `outputs` are further
    keys read from their program by the caller; `reads[k][d]` the leaves of `d` that `k`
    reads (None: all), so another worker is sent only those."""
    tasks = set(tasks)
    keep = set(keep)
    order_all = topological(deps)
    direct: set[str] = set()
    for key in order_all:
        if key not in tasks or key in keep or worker_of.get(key) is None:
            continue
        if all(d in direct or d not in tasks for d in deps[key]):
            direct.add(key)
    if not direct:
        return Plan((), frozenset())
    inbox = {k: [d for d in deps[k] if d in direct] for k in direct}
    readers: dict[str, list[str]] = collections.defaultdict(list)
    for k in sorted(direct):
        for d in inbox[k]:
            readers[d].append(k)
    exports = {d for k in tasks if k not in direct for d in deps.get(k, ()) if d in direct}
    exports |= set(outputs) & direct
    where = {k: str(worker_of[k]) for k in direct}
    rank = {k: i for i, k in enumerate(order_all)}
    order = linearize(inbox, where, {k: priority[k] for k in direct if k in priority}, rank)
    programs = []
    for w in sorted(order):
        actions = []
        statics: set[str] = set()
        for k in order[w]:
            by_worker = collections.Counter(where[c] for c in readers.get(k, ()))
            local = by_worker.pop(w, 0)
            remote = tuple(
                Consumers(ww, n, _leaves(k, [c for c in readers[k] if where[c] == ww], reads))
                for ww, n in sorted(by_worker.items()))
            statics.update(d for d in deps[k] if d not in direct)
            actions.append(PlannedAction(k, tuple((d, where[d]) for d in inbox[k]), local,
                                         remote, k in exports))
        programs.append(ProgramPlan(w, tuple(actions), tuple(sorted(statics))))
    return Plan(tuple(programs), frozenset(direct))


def _leaves(key: str, consumers: list[str],
            reads: Mapping[str, Mapping[str, frozenset[int] | None]] | None
            ) -> frozenset[int] | None:
    """The leaves of `key`'s value that `consumers` read (None: the whole value)."""
    if reads is None:
        return None
    out: set[int] = set()
    for c in consumers:
        got = reads.get(c, {}).get(key)
        if got is None:
            return None
        out |= got
    return frozenset(out)


def linearize(deps: Mapping[str, list[str]], worker_of: Mapping[str, str],
              priority: Mapping[str, int],
              rank: Mapping[str, int] | None = None) -> dict[str, list[str]]:
    """Per worker, the order its tasks run in: tasks with a priority (schedule actions)
    in decreasing priority, the others as soon as their inputs exist in a simulated run
    of the schedule (one action per worker per round). Orders taken from one valid
    sequential run cannot deadlock. `rank`: a topological rank of every key (ties of
    priority); computed here when not given.

    The schedule itself was checked when it was built (`dagdiff.schedules.simulate`),
    so a stuck run here means the graph and the schedule disagree: it raises, naming
    what each worker waits for."""
    users: dict[str, list[str]] = collections.defaultdict(list)
    missing = {k: 0 for k in deps}
    for k, ds in deps.items():
        for d in ds:
            users[d].append(k)
            missing[k] += 1
    topo = rank if rank is not None else {k: i for i, k in enumerate(topological(deps))}
    queues: dict[str, collections.deque[str]] = {}
    for w in sorted(set(worker_of.values())):
        acts = sorted((k for k in deps if worker_of[k] == w and k in priority),
                      key=lambda k: (-priority[k], topo[k]))
        queues[w] = collections.deque(acts)
    order: dict[str, list[str]] = {w: [] for w in queues}
    # small tasks without inputs (microbatch slices) go right before their first
    # consumer, so a worker's first action waits for one of them, not for all
    lazy = {k for k in deps if k not in priority and not missing[k] and users.get(k)}
    for k in lazy:
        for u in users[k]:
            missing[u] -= 1
    free = collections.deque(sorted((k for k in deps if k not in priority and not missing[k]
                                     and k not in lazy), key=topo.__getitem__))
    placed = 0

    def place(k: str) -> None:
        nonlocal placed
        for d in deps[k]:
            if d in lazy:            # its consumers no longer count it as missing
                lazy.discard(d)
                order[worker_of[d]].append(d)
                placed += 1
        order[worker_of[k]].append(k)
        placed += 1
        for u in users.get(k, ()):
            missing[u] -= 1
            if not missing[u] and u not in priority:
                free.append(u)

    def drain() -> None:
        while free:
            place(free.popleft())

    drain()
    while placed < len(deps):
        progressed = False
        for w, q in queues.items():
            if q and not missing[q[0]]:
                place(q.popleft())
                drain()
                progressed = True
        if not progressed:
            stuck = []
            done = {k for ks in order.values() for k in ks}
            for w, q in queues.items():
                if q:
                    waits = [d for d in deps[q[0]] if d not in done]
                    stuck.append(f"{w} at {q[0]} (waits for {', '.join(waits[:3])})")
            raise DirectDispatchError(
                "the schedule cannot run: every worker waits for a task that comes later "
                f"in another worker's order: {'; '.join(stuck) or 'no action left'}. Check "
                "the Schedule's actions (each F needs the previous stage's F of that "
                "microbatch, each B the next stage's B).")
    return order
