"""Rewrite a step's task graph for direct dispatch: one program task per worker, carrying
the step's run id, and the step's outputs as ordinary tasks waiting for every program."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Collection, Mapping

from dask.base import tokenize

from ...core.keys import make_key, sanitize
from ...errors import PlacementError
from ..live import enabled as live_actions
from ..tasks import leaves_read
from ..taskspec import DataNode, Task, TaskRef
from .plan import ProgramPlan, plan_programs
from .results import Export, LocalImport, ProgramResult
from .program import Program
from .runtime import (NONCE_TAKERS, RunNonce, _timeout, new_nonce, run_program, run_programs,
                      runtime)


__all__ = ["DirectGraph", "rewrite", "next_base", "RESOURCE_SHARE", "chain_step",
           "Source", "merge_window", "WindowError", "group_outputs", "run_gathered",
           "push_output", "plain_output", "own_outputs", "own_output"]

log = logging.getLogger(__name__)

#: share of a slot resource one program holds: a program leaves the thread pool
#: (``secede``) but keeps its resources, so whole units would block the worker's next
#: task, e.g. the next step's program (2**-20: exact in binary)
RESOURCE_SHARE = 2.0 ** -20
_COUNTER = itertools.count(1)


def next_base() -> int:
    """The priority base of the next step: later steps rank below earlier ones on every
    worker."""
    return -10_000_000 * next(_COUNTER)


@dataclasses.dataclass(frozen=True)
class DirectGraph:
    """The rewritten graph: tasks, and the placement and priority of the new tasks
    (programs, the tasks that pick a program's exports)."""

    dsk: dict[str, Any]
    priority: dict[str, int]
    placed: dict[str, str]             # new task -> its worker
    programs: tuple[Program, ...]
    base: int = 0                      # the step's priority base (`next_base`)


def rewrite(dsk: Mapping[str, Any], worker_of: Mapping[str, str | None],
            priority: Mapping[str, int], keep: Collection[str],
            addresses: Mapping[str, str], token: str, slots: bool = True,
            timeout: float | None = None, outputs: Collection[str] = ()) -> DirectGraph:
    """Turn every task that has a worker (and is not in `keep`, the step's outputs that
    stay ordinary tasks, and does not wait on an ordinary task) into an action of its
    worker's program (see `dagdiff.runtime.direct.plan`).

    Each program task carries the step's run id (a `RunNonce`), which dagdiff's scheduler
    plugin stamps afresh, the same for all of them, each time they are submitted:
    computing the step again (the same Delayed, a re-run cell) runs the programs under a
    new run id, so its messages never mix with an earlier run's, and no task or round
    trip makes the id before the programs start. Data
    the programs read (the batch) is embedded in their tasks, not scattered: the graph
    stays recomputable, and its keys name one computation.

    `keep` outputs wait for every program of the step (so computing any of them runs
    the whole step) and read their values from their own worker's program result in
    place; the other programs' results reach them as stubs (`results`). `outputs` are
    keys the caller reads straight from their program (e.g. a Trainer's new parameters,
    read by the next step on the same worker, through a task that picks them): they
    cost no cross-worker Dask edge, and the closing exchange makes each of them fail
    when any program of the step fails.

    `worker_of`: key -> slot name (or address when `slots` is False); `priority`: the
    schedule's priorities; `addresses`: slot -> worker address. The programs report
    their actions to the dashboard's Task Stream unless dask config
    ``dagdiff.dashboard.live-actions`` is False now (`dagdiff.runtime.live`)."""
    if timeout is None:
        timeout = _timeout()
    live = live_actions()
    dsk = dict(dsk)
    keep = set(keep)
    tasks = {k for k, t in dsk.items() if isinstance(t, Task)}
    deps = {k: (_data_deps(t) if k in tasks else []) for k, t in dsk.items()}
    reads = {k: leaves_read(dsk[k]) for k in tasks if k not in keep}
    plan = plan_programs(deps, tasks, worker_of, priority, keep, outputs, reads)
    if not plan.programs:
        return DirectGraph(dsk, {}, {}, ())
    missing = sorted({p.where for p in plan.programs if p.where not in addresses}) if slots \
        else []
    if missing:
        raise PlacementError(f"direct dispatch: no worker address for {', '.join(missing)}; "
                             "is every slot's worker running?")

    def addr(w: str) -> str:
        return addresses[w] if slots else w

    # data read only by programs travels inside their tasks
    readers_outside = {d for k in tasks - plan.direct for d in dsk[k].dependencies}
    inline = {k for k, t in dsk.items() if isinstance(t, DataNode) and k not in
              readers_outside}
    step = token
    base = next_base()
    out_priority: dict[str, int] = {}
    placed: dict[str, str] = {}
    nonce = RunNonce(new_nonce())       # stamped afresh by the scheduler per submission
    members_all = [(p.where, addr(p.where)) for p in plan.programs]
    # the program that can run longest before it waits for another worker (stage 0's,
    # which starts the pipeline) is sent first: the scheduler sends equal-priority tasks
    # in no set order, and every other worker waits for it
    lead = max(range(len(plan.programs)), key=lambda i: _leading(plan.programs[i]))
    programs = []
    exported: dict[str, int] = {}          # exported action key -> its program's index
    for i, pp in enumerate(plan.programs):
        w = pp.where
        actions = []
        for pa in pp.actions:
            t = dsk.pop(pa.key)
            kwargs = {n: v for n, v in t.kwargs.items() if not _ordering_only(n, v, plan.direct)}
            actions.append(dataclasses.replace(
                pa, task=Task(pa.key, t.func, *t.args, **kwargs),
                remote=tuple(dataclasses.replace(c, address=addr(c.where))
                             for c in pa.remote)))
            if pa.export:
                exported[pa.key] = i
        pk = make_key("program", sanitize(w), i, token)
        prog = Program(pk, step, w, addr(w), tuple(actions), pp.statics, timeout,
                       tuple(m for m in members_all if m[0] != w), live)
        args: list[Any] = []
        for s in pp.statics:
            node = dsk.get(s)
            args.append(node.value if s in inline and isinstance(node, DataNode)
                        else TaskRef(s))
        dsk[pk] = Task(pk, run_program, prog, nonce, *args)
        placed[pk] = w
        out_priority[pk] = base + (1 if i == lead else 0)
        programs.append(prog)
    for k in inline:
        dsk.pop(k, None)
    # every output waits for every program (computing any of them runs the whole step)
    # and reads its own worker's program result in place; the others' results are
    # dependencies for order alone and travel as stubs (`results.ProgramResult`)
    index = {p.where: i for i, p in enumerate(programs)}
    prog_refs = [TaskRef(p.key) for p in programs]
    for k, t in list(dsk.items()):
        if k in keep and isinstance(t, Task):
            here = index.get(worker_of.get(k))   # type: ignore[arg-type]

            def local(v: Any) -> Any:
                if isinstance(v, TaskRef) and exported.get(v.key, -1) == here:
                    return Export(v.key)
                return v

            kwargs = {n: local(v) for n, v in t.kwargs.items()
                      if not _ordering_only(n, v, plan.direct)}
            dsk[k] = Task(k, _output, -1 if here is None else here, len(prog_refs), *prog_refs,
                          t.func, *map(local, t.args), **kwargs)
    # an export any other task reads (a Trainer's new parameters, `outputs`): one small
    # task on the program's worker picks it from the program's result
    wanted = set(outputs)
    for k, t in dsk.items():
        if isinstance(t, Task) and t.func is not run_program:
            wanted.update(d for d in t.dependencies if d in exported)
    for key in sorted(wanted & set(exported)):
        prog = programs[exported[key]]
        dsk[key] = Task(key, _pick, TaskRef(prog.key), key)
        placed[key] = prog.where
    return DirectGraph(dsk, out_priority, placed, tuple(programs), base)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where an output picked from a program's result comes from: the program's run
    (`serial`, unique per submission of the step), the action it exports, and the
    program's worker address."""

    serial: str
    export: str
    address: str


def chain_step(dsk: dict[str, Any], sources: Mapping[str, Source], keys: Collection[str]
               ) -> dict[str, Source]:
    """Rewrite `dsk` (a direct-dispatch step's tasks, about to be submitted) in place so
    that each program reads the values of `sources` made on its own worker straight from
    the earlier program's exports (`LocalImport`) instead of through a Dask dependency:
    the scheduler sends the program at once, and it starts the moment the program of the
    step before ends on its worker. Each value moved stays a Dask dependency of a task
    that picks an export of the same program (same worker: nothing is transferred), so
    it lives as long as the step and computing the step still computes the one before.
    Every program gets a serial naming this submission (its exports are kept under it on
    its worker). Returns the sources of `keys` (this step's values that are picked from
    a program) for the next step."""
    serials: dict[str, str] = {}
    picks: dict[str, str] = {}
    for k, t in dsk.items():
        if isinstance(t, Task) and t.func is _pick and isinstance(t.args[0], TaskRef):
            picks.setdefault(str(t.args[0].key), k)
    for k, t in list(dsk.items()):
        if not (isinstance(t, Task) and t.func is run_program):
            continue
        prog: Program = t.args[0]
        serial = serials[k] = new_nonce()
        args, moved = list(t.args[2:]), []
        if k in picks:
            for i, a in enumerate(args):
                src = sources.get(str(a.key)) if isinstance(a, TaskRef) else None
                if src is not None and src.address == prog.address:
                    args[i] = LocalImport(str(a.key), src.serial, src.export)
                    moved.append(a)
        dsk[k] = Task(k, run_program, prog, t.args[1], *args, **{**t.kwargs, "serial": serial})
        if moved:
            pick = dsk[picks[k]]
            dsk[picks[k]] = Task(picks[k], _pick, *pick.args, *moved)
    out: dict[str, Source] = {}
    for k in keys:
        t = dsk.get(k)
        if not (isinstance(t, Task) and t.func is _pick and isinstance(t.args[0], TaskRef)):
            continue
        pk = str(t.args[0].key)
        if pk in serials:
            out[k] = Source(serials[pk], str(t.args[1]), dsk[pk].args[0].address)
    return out


class WindowError(ValueError):
    """Steps that cannot run as one window (`merge_window`): submit them one by one."""


def merge_window(steps: list[dict[str, Any]], loss_keys: list[str],
                 state_keys: list[list[str]]) -> tuple[dict[str, Any], dict[str, str]]:
    """k chained direct-dispatch steps (each rewritten by `rewrite` and chained by
    `chain_step` to the one before, whose state its programs read in place) as one
    submission: per worker one task that runs its k programs in order (`run_programs`),
    the first step's run id (each step's token already names its runs), one output with
    the k losses (a tuple), and the last step's state picks (which keep the first step's
    state as their dependency, as `chain_step` does); the output and the picks under the
    keys of the last step's with a token of the window's own. Returns the new tasks and,
    per new task, the key of the steps' task it stands for (whose placement and priority
    it takes). Raises `WindowError` where a step reads a value no task of the window keeps
    (e.g. a state moved to another worker within the window)."""
    k = len(steps)
    progs: dict[str, list[tuple[Program, str, tuple[Any, ...]]]] = {}
    address_of: dict[str, str] = {}              # program key -> its worker
    first_prog: dict[str, str] = {}              # worker -> step 0's program key
    nonce = ""
    for i, dsk in enumerate(steps):
        for key, t in dsk.items():
            if not (isinstance(t, Task) and t.func is run_program):
                continue
            prog: Program = t.args[0]
            if i == 0:
                nonce = nonce or t.args[1]
                first_prog[prog.address] = key
            elif prog.address not in first_prog:
                raise WindowError(f"step {i} of the window runs on {prog.address}, step 0 not")
            address_of[key] = prog.address
            progs.setdefault(prog.address, []).append(
                (prog, str(t.kwargs.get("serial", "")), tuple(t.args[2:])))
    if not nonce or any(len(v) != k for v in progs.values()):
        raise WindowError("the window's steps do not run a program on the same workers")
    dropped = {key for dsk in steps[:-1] for key in dsk} | {
        key for dsk in steps[-1:] for key, t in dsk.items()
        if isinstance(t, Task) and t.func is run_program}
    # the window's tasks get keys of their own: the same last step submitted alone (or in
    # another window) makes the same values with other tasks; one key names one task for
    # the scheduler (a re-run fit cell may group its steps otherwise, or start from an
    # older state, whose first step's token says how it reads that state)
    wtoken = tokenize("window", k, str(loss_keys[0]), str(loss_keys[-1]))[:16]
    seq = {a: make_key("program", f"{sanitize(ps[0][0].where)}_x{k}", i, wtoken)
           for i, (a, ps) in enumerate(sorted(progs.items()))}
    keep: dict[str, set[str]] = {a: set() for a in progs}
    new: dict[str, Any] = {}
    takes: dict[str, str] = {}
    # the k losses as one output, on the last loss's worker
    order = sorted(seq)
    flat: list[Any] = []
    remote: dict[str, list[str]] = {}            # worker -> names its part gives
    for i, (dsk, lk) in enumerate(zip(steps, loss_keys)):
        t = plain_output(dsk[lk])
        if not (isinstance(t, Task) and t.func is _output) or t.kwargs:
            raise WindowError(f"step {i}'s loss {lk} is not a plain output of its programs")
        here, n = t.args[0], t.args[1]
        refs, func, args = t.args[2:2 + n], t.args[2 + n], t.args[3 + n:]
        addr = address_of[str(refs[here].key)] if here >= 0 else None
        mine = []
        for a in args:
            if isinstance(a, Export):       # its name in the window's result
                a = Export(f"{i}:{a.key}")
                keep[addr].add(a.key)       # type: ignore[index]
            elif isinstance(a, TaskRef):    # picked from another worker's program
                pick = dsk.get(a.key)
                if not (isinstance(pick, Task) and pick.func is _pick
                        and str(pick.args[0].key) in address_of):
                    raise WindowError(f"step {i}'s loss reads {a.key}, which no program of "
                                      "the window makes")
                there = address_of[str(pick.args[0].key)]
                names = remote.setdefault(there, [])
                names.append(f"{i}:{pick.args[1]}")
                keep[there].add(names[-1])
                a = Export(names[-1], at=len(order) + list(remote).index(there))
            mine.append(a)
        flat.extend((order.index(addr) if addr is not None else 0, func, len(mine), *mine))
    # values of other workers (a loss averaged over replicas): one task on each picks
    # them from its window task (a program result travels between workers as a stub)
    parts = []
    for there, names in remote.items():
        pk = make_key("outputs", f"{sanitize(progs[there][0][0].where)}_x{k}", 0, wtoken)
        new[pk] = Task(pk, _picks, TaskRef(seq[there]), *names)
        takes[pk] = first_prog[there]
        parts.append(TaskRef(pk))
    def renamed(key: str) -> str:
        return f"{key.rsplit('-', 1)[0]}-{wtoken}"

    out_key = renamed(loss_keys[-1])
    new[out_key] = Task(out_key, _outputs_of, len(order) + len(parts), k,
                        *(TaskRef(seq[a]) for a in order), *parts, *flat)
    takes[out_key] = loss_keys[-1]
    # the last step's state, picked from its worker's window task; the dependencies a
    # first step's pick keeps (the state before the window) move to it
    before: dict[str, list[Any]] = {}
    for key in state_keys[0]:
        t = steps[0][key]
        if isinstance(t, Task) and t.func is _pick:
            before.setdefault(address_of[str(t.args[0].key)], []).extend(t.args[2:])
    for key in state_keys[-1]:
        t = steps[-1][key]
        if not (isinstance(t, Task) and t.func is _pick):
            raise WindowError(f"the window's state {key} is not picked from a program")
        addr = address_of[str(t.args[0].key)]
        name = f"{k - 1}:{t.args[1]}"         # the export it picks (a template's name)
        keep[addr].add(name)
        new[renamed(key)] = Task(renamed(key), _pick, TaskRef(seq[addr]), name,
                                 *before.pop(addr, ()))
        takes[renamed(key)] = key
    for addr, ps in progs.items():
        args: list[Any] = []
        for prog, serial, statics in ps:
            for a in statics:
                if isinstance(a, TaskRef) and str(a.key) in dropped:
                    raise WindowError(f"{prog.key} reads {a.key}, which the window drops")
            args.extend((prog, serial, len(statics), *statics))
        key = seq[addr]
        new[key] = Task(key, run_programs, key, k, nonce, *args,
                        keep=tuple(sorted(keep[addr])))
        takes[key] = first_prog[addr]
    return new, takes


async def _outputs_of(n: int, k: int, *rest: Any) -> tuple[Any, ...]:
    """`k` outputs in one task (a window's losses, `group_outputs`'s outputs of one
    worker): each computed as its own output task would, from its part of the `n`
    program results (each output: the index of its result, its function, its argument
    count and arguments; an `Export` with `at` reads result `at`, which may be a
    `_picks` dict of another worker's values)."""
    return _outputs(n, k, rest)


def _outputs(n: int, k: int, rest: tuple[Any, ...]) -> tuple[Any, ...]:
    """`_outputs_of`, called in place."""
    results, at, out = rest[:n], n, []
    for _ in range(k):
        here, func, count = rest[at], rest[at + 1], rest[at + 2]
        args = rest[at + 3:at + 3 + count]
        at += 3 + count
        out.append(func(*(_exported(results[here if a.at < 0 else a.at], a.key)
                          if isinstance(a, Export) else a for a in args)))
    return tuple(out)


def _exported(result: Any, key: str) -> Any:
    """Export `key` from a program result, or from the dict a `_picks` task made."""
    return result.value(key) if isinstance(result, ProgramResult) else result[key]


async def _picks(result: ProgramResult, *keys: str) -> dict[str, Any]:
    """The exports `keys` of a program (window) result, as a plain dict that travels."""
    return {k: result.value(k) for k in keys}


def group_outputs(dsk: Mapping[str, Any], keys: Collection[str], nonce: str | None = None,
                  inbox: str = "") -> tuple[dict[str, Any], dict[str, str],
                                            dict[str, tuple[str, int]], set[str]]:
    """The outputs `keys` of a direct-dispatch step (`dsk`, as `rewrite` made it) that
    its programs' results give on one worker, as one task per worker (for a caller that
    gathers them all at once: each output task costs Dask ~1.5 ms here, and the 9 of the
    tiny job were a quarter of its step). Each group task returns its outputs as a tuple.
    Where every program has a group and nothing else reads the programs, each group is
    its program's task itself (`run_gathered`: the program, then its outputs, one task
    per worker: no hop through the scheduler between the two); the closing exchange
    makes a program fail when any other does, so it needs no other program's result.
    Otherwise each group waits for every program, as the outputs did.

    `nonce`: a fresh run id for this submission (a caller that builds the graph for one
    submission, as `step.compute` does): where every program became its group, their
    keys end with it (each call's graph is its own). `inbox`: the id of the client's
    inbox (`inbox.ClientInbox`) such program tasks push their outputs to as they end
    (besides returning them).

    Returns the new tasks, per new task the key whose placement and priority it takes,
    per grouped key ``(group key, index)``, and the program keys the groups replace;
    keys that are not plain output tasks of one worker are left out and stay as they
    are."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for key in dict.fromkeys(keys):
        t = dsk.get(key)
        if not (isinstance(t, Task) and t.func is _output) or t.kwargs or t.args[0] < 0:
            continue
        refs = tuple(str(r.key) for r in t.args[2:2 + t.args[1]])
        home = dsk.get(refs[t.args[0]])
        if isinstance(home, Task) and home.func is run_program:
            groups.setdefault(refs, []).append(key)
    new: dict[str, Any] = {}
    takes: dict[str, str] = {}
    where: dict[str, tuple[str, int]] = {}
    fused: set[str] = set()
    grouped = {key for members in groups.values() for key in members}
    read_elsewhere = {str(d) for k, t in dsk.items() if k not in grouped and isinstance(t, Task)
                      for d in t.dependencies}
    for refs, members in groups.items():
        by_here: dict[int, list[str]] = {}
        for key in members:
            by_here.setdefault(dsk[key].args[0], []).append(key)
        # a program runs its outputs itself when every program has outputs (so computing
        # them all runs every program), no output reads another program's result and no
        # other task reads a program: a program ends only once the whole run succeeded
        # (its closing exchange), so the other programs' results would only be stubs
        own = (set(by_here) == set(range(len(refs))) and not read_elsewhere & set(refs)
               and not any(isinstance(a, Export) and a.at >= 0
                           for key in members for a in dsk[key].args[3 + dsk[key].args[1]:]))
        for here, mine in sorted(by_here.items()):
            pt: Task = dsk[refs[here]]
            prog: Program = pt.args[0]
            fresh = nonce if own and nonce is not None else ""   # this submission's run id
            gk = make_key("program", f"{sanitize(prog.where)}_out", here, prog.step + fresh) \
                if own else make_key("outputs", sanitize(prog.where), here, prog.step)
            flat: list[Any] = []
            for i, key in enumerate(mine):
                t = dsk[key]
                n = t.args[1]
                args = t.args[3 + n:]
                flat.extend((0 if own else t.args[0], t.args[2 + n], len(args), *args))
                where[key] = (gk, i)
            if own:
                extra = {"inbox": inbox} if inbox else {}
                new[gk] = Task(gk, run_gathered, gk, len(mine), prog, fresh or pt.args[1],
                               *pt.args[2:], *flat, **pt.kwargs, **extra)
                takes[gk] = refs[here]
                fused.add(refs[here])
            else:
                new[gk] = Task(gk, _outputs_of, len(refs), len(mine),
                               *(TaskRef(r) for r in refs), *flat)
                takes[gk] = mine[0]
    return new, takes, where, fused


def own_outputs(dsk: Mapping[str, Any], keys: Collection[str],
                known: Collection[str] = ()) -> dict[str, Any]:
    """The output tasks among `keys` (computed together, from `dsk`, a direct-dispatch
    step's tasks as `rewrite` made them) that may wait for their own worker's program
    alone, rewritten so. An output qualifies when the scheduler knows (`known`) neither
    it nor the programs of its step (a fresh run of the step: its programs start
    together and end together), and when, for every program it waits for, some output
    computed here, or another task computed here, waits for it: every program of the
    step then runs anyway, and the closing exchange makes a program fail when any other
    does, so an output needs no other program's result. It then runs the moment its own
    program ends, with no fetch of the other programs' stubs (a Dask transfer each) and
    no wait for the scheduler to hear of every program's end.

    Returns the rewritten tasks (key -> task); outputs that read another program's
    result (`Export` with `at`) are left out."""
    known = set(known)
    wanted = [k for k in dict.fromkeys(keys) if k not in known]

    def waits_for(key: str) -> list[str]:
        return [str(r.key) for r in dsk[key].args[2:2 + dsk[key].args[1]]]

    mine = {k: t for k in wanted if (t := own_output(dsk, k)) is not None
            and not known.intersection(waits_for(k))}
    while mine:       # drop the outputs of steps whose programs would not all run
        reached = _computed(wanted, known, lambda k: mine[k] if k in mine else dsk.get(k))
        short = {k for k in mine if not set(waits_for(k)) <= reached}
        if not short:
            break
        mine = {k: t for k, t in mine.items() if k not in short}
    return mine


def own_output(dsk: Mapping[str, Any], key: str) -> Task | None:
    """Output task `key` of `dsk` waiting for its own worker's program alone (see
    `own_outputs`), or None where it is not a plain output task or reads another
    program's result."""
    t = dsk.get(key)
    if not (isinstance(t, Task) and t.func is _output) or t.args[0] < 0:
        return None
    n = t.args[1]
    refs = t.args[2:2 + n]
    if not all(isinstance(r, TaskRef) and isinstance(p := dsk.get(str(r.key)), Task)
               and p.func is run_program for r in refs):
        return None
    if any(isinstance(a, Export) and a.at >= 0 for a in (*t.args[3 + n:], *t.kwargs.values())):
        return None
    return Task(key, _output, 0, 1, refs[t.args[0]], *t.args[2 + n:], **t.kwargs)


def _computed(keys: Collection[str], held: Collection[str], task: Any) -> set[str]:
    """The keys computing `keys` runs (`task(key)`: its task; `held` keys and what only
    they read do not run)."""
    seen: set[str] = set()
    stack = list(keys)
    while stack:
        k = stack.pop()
        if k in seen or k in held:
            continue
        seen.add(k)
        t = task(k)
        if isinstance(t, Task):
            stack.extend(str(d) for d in t.dependencies)
    return seen


def run_gathered(task: str, k: int, prog: Program, nonce: str, /, *rest: Any,
                 serial: str = "", inbox: str = "") -> tuple[Any, ...]:
    """A program task that hands back its worker's `k` outputs (`group_outputs`): runs
    `prog` as `run_program` does (`rest`: its inputs, then the outputs as `_outputs_of`
    takes them) and returns the outputs, not its result; with `inbox`, it first pushes
    them to that client inbox (`inbox.InboxEnds.push`)."""
    n = len(prog.statics)
    rt = runtime()
    try:
        result = rt.run(prog, nonce, tuple(rest[:n]), serial, task=task)
        outputs = _outputs(1, k, (result, *rest[n:]))
        if inbox:
            try:
                rt.inboxes.push(inbox, task, outputs)
            except Exception:                   # noqa: BLE001 - the client gathers them
                log.exception("dagdiff: pushing the outputs of %s failed", task)
    finally:
        rt.end_task(task)
    return outputs


NONCE_TAKERS.append(run_gathered)


def _leading(pp: ProgramPlan) -> int:
    """How many actions a planned program runs before the first that reads another
    worker's value."""
    for n, a in enumerate(pp.actions):
        if any(src != pp.where for _, src in a.inputs):
            return n
    return len(pp.actions)


def _ordering_only(name: str, value: Any, direct: Collection[str]) -> bool:
    """`after_<i>` keyword arguments are the scheduler-mode ordering edges; actions
    run in their program's order instead."""
    return name.startswith("after_") and isinstance(value, TaskRef) and value.key in direct


def _data_deps(t: Task) -> list[str]:
    """Data dependencies of a task (ordering-only `after_` edges left out)."""
    skip = {v.key for n, v in t.kwargs.items()
            if n.startswith("after_") and isinstance(v, TaskRef)}
    return sorted(set(t.dependencies) - skip)


# The tasks after a step's programs are coroutine functions: a worker runs them on its
# event loop, not in its thread pool (they only pick values, or average a few scalars),
# so the ~9 of them per worker follow each other without a thread hand-off each.

async def _pick(result: ProgramResult, key: str, *keep: Any) -> Any:
    """The value of action `key`, from its program's result (`keep`: values of the step
    before that its programs took in place, `chain_step`: dependencies only)."""
    return result.value(key)


async def _output_pushed(key: str, here: int, n: int, *rest: Any, **kwargs: Any) -> Any:
    """`_output` (task `key`) whose value also goes to every client inbox open on its
    worker (`push_output`: a Trainer step's loss, which the client waits for), unless
    its program pushed it already."""
    value = await _output(here, n, *rest, **kwargs)
    try:
        inboxes = runtime().inboxes
        if not inboxes.pushed_before(key):
            inboxes.push_all(key, value)
    except Exception:                           # noqa: BLE001 - the client gathers it
        log.exception("dagdiff: pushing %s failed", key)
    return value


def push_output(dsk: dict[str, Any], key: str) -> bool:
    """Make output task `key` of a rewritten step (`dsk`, changed in place) push its
    value to the client inboxes open on its worker; False if `key` is not a plain output
    task. Where its own worker's program result gives it alone (no other task's value,
    no keyword), that program pushes it as soon as its run succeeded (`run_program`'s
    `push`: a run succeeds on every worker or on none), a scheduler hop and a fetch of
    the other programs' results before the output task would; the task then pushes only
    what its program did not."""
    t = dsk.get(key)
    if not (isinstance(t, Task) and t.func is _output):
        return False
    dsk[key] = Task(key, _output_pushed, key, *t.args, **t.kwargs)
    here, n = t.args[0], t.args[1]
    refs, func, args = t.args[2:2 + n], t.args[2 + n], t.args[3 + n:]
    own = {str(r.key) for r in refs}
    if here < 0 or t.kwargs or set(map(str, t.dependencies)) - own:
        return True
    pt = dsk.get(str(refs[here].key))
    if isinstance(pt, Task) and pt.func is run_program and "push" not in pt.kwargs:
        dsk[pt.key] = Task(pt.key, run_program, *pt.args,
                           **{**pt.kwargs, "push": (key, func, tuple(args))})
    return True


def plain_output(t: Any) -> Any:
    """An output task as `_output` (a pushing one without its push)."""
    if isinstance(t, Task) and t.func is _output_pushed:
        return Task(t.key, _output, *t.args[1:], **t.kwargs)
    return t


async def _output(here: int, n: int, *rest: Any, **kwargs: Any) -> Any:
    """An output task: waits for the step's `n` program results, reads the `Export`
    arguments from result `here` (its own worker's), and applies its function."""
    results, func, args = rest[:n], rest[n], rest[n + 1:]

    def value(v: Any) -> Any:
        return results[here].value(v.key) if isinstance(v, Export) else v

    return func(*map(value, args), **{n: value(v) for n, v in kwargs.items()})
