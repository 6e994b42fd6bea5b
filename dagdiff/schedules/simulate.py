"""The one schedule simulator (feasibility, makespan, bubble) and the textbook formulas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..errors import ScheduleError
from .action import Action
from .base import Schedule, is_pos_int, schedule_error
from .builtin import get_schedule


__all__ = ["SimResult", "simulate", "ideal_makespan", "bubble_formula"]


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`; ``spans[w]`` holds (action, start, end) per worker w."""

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    spans: tuple[tuple[tuple[str, float, float], ...], ...]


def simulate(
    schedule: str | Schedule,
    num_stages: int,
    microbatches: int,
    f: float = 1.0,
    b: float = 2.0,
    i: float | None = None,
    w: float | None = None,
    comm: float = 0.0,
    *,
    stage_costs: Mapping[int, Mapping[str, float]] | None = None,
    edge_comm: Mapping[tuple[int, int], float] | None = None,
    contention: float = 0.0,
    hosts: Sequence[Hashable] | None = None,
) -> SimResult:
    """Run each worker's actions strictly in order, each as early as dependencies allow.

    Chunk c on worker s is global stage g = ``schedule.stage_layout(p)[s][c]`` (c * p + s
    unless the schedule places its chunks otherwise, e.g. in a V). F at g needs F at g - 1;
    B or I at g needs B or I at g + 1 (the last global stage needs its own F); W needs I at
    the same stage. ``comm`` is added to every dependency whose stage lives on another
    worker (none between the two stages a V layout keeps on one worker). Costs: F = f,
    B = b, I = i and W = w (both default to b / 2), each divided by the number of
    virtual stages. ``bubble_fraction`` = 1 - sum(busy) / (p * makespan).

    Measured costs (`dagdiff.plan.predict` passes a profile's): ``stage_costs[g]`` maps
    kinds "F", "B", "I", "W" to the cost of one action at global stage g, as is (not
    divided by the virtual stages); a kind it leaves out is derived from the stage's
    others (B = I + W when both are given, I = W = B / 2 when B is) or else takes the
    uniform cost above. ``edge_comm[(src, dst)]`` replaces ``comm`` on the dependency of
    an action at global stage dst on one at src (forward: (g - 1, g), backward:
    (g + 1, g)) when the two stages live on different workers.

    ``contention`` > 0 makes workers on one host share it (processor sharing): costs are
    then the seconds of an action running alone on its host, and while n workers of a
    host run actions at once each progresses at rate 1 / (1 + contention x (n - 1)), so
    1 means they split the host evenly (two workers whose XLA uses every core), 0 (the
    default) that they never slow each other down. ``hosts[s]`` names worker s's host
    (default: all on one).
    """
    sched = get_schedule(schedule)
    orders = sched.table(num_stages, microbatches)
    p, v = num_stages, sched.virtual_stages
    costs = {"F": f, "B": b, "I": b / 2 if i is None else i, "W": b / 2 if w is None else w}
    for label, value in (*costs.items(), ("comm", comm)):
        _check_cost(sched.name, num_stages, microbatches, label, value)
    costs = {kind: cost / v for kind, cost in costs.items()}
    last = p * v - 1
    layout = sched.checked_layout(p)
    worker_of = {g: s for s, stages in enumerate(layout) for g in stages}
    per_stage = _stage_costs(sched.name, num_stages, microbatches, costs, stage_costs, last)
    edges = _edge_comm(sched.name, num_stages, microbatches, edge_comm, last)
    _check_cost(sched.name, num_stages, microbatches, "contention", contention)
    if hosts is not None and len(hosts) != p:
        raise schedule_error(sched.name, num_stages, microbatches,
                             f"hosts names {len(hosts)} hosts for {p} workers",
                             "pass one host name per worker, or none (all on one host)")
    host_of = [0] * p if hosts is None else list(hosts)

    for s, worker in enumerate(orders):
        seen: set[Action] = set()
        for a in worker:
            if a.chunk >= v or a in seen or a.microbatch >= microbatches:
                raise schedule_error(
                    sched.name, num_stages, microbatches,
                    f"worker {s} has an invalid or repeated action {a.format(v > 1)}",
                    "emit each (kind, microbatch < microbatches, chunk < virtual_stages) "
                    "at most once per worker",
                )
            seen.add(a)

    # Finish times keyed by (phase, global stage, microbatch); phase "B" covers B and I.
    finished: dict[tuple[str, int, int], float] = {}
    weights_ready: dict[tuple[int, int], float] = {}
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    spans: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]

    def ready_at(s: int, a: Action) -> float | None:
        g = layout[s][a.chunk]
        if a.kind == "F":
            deps = [("F", g - 1)] if g > 0 else []
        elif a.kind == "W":
            return weights_ready.get((g, a.microbatch))
        else:
            deps = [("B", g + 1)] if g < last else [("F", g)]
        start = 0.0
        for phase, dg in deps:
            t = finished.get((phase, dg, a.microbatch))
            if t is None:
                return None
            start = max(start, t + (edges.get((dg, g), comm) if worker_of[dg] != s else 0.0))
        return start

    def run(s: int, a: Action, start: float, end: float) -> None:
        g = layout[s][a.chunk]
        if a.kind == "F":
            finished[("F", g, a.microbatch)] = end
        elif a.kind in ("B", "I"):
            finished[("B", g, a.microbatch)] = end
            if a.kind == "I":
                weights_ready[(g, a.microbatch)] = end
        clock[s] = end
        busy[s] += end - start
        spans[s].append((a.format(v > 1), start, end))
        position[s] += 1

    if not contention:
        progress = True
        while progress:
            progress = False
            for s in range(p):
                worker = orders[s]
                while position[s] < len(worker):
                    a = worker[position[s]]
                    dep_time = ready_at(s, a)
                    if dep_time is None:
                        break
                    start = max(clock[s], dep_time)
                    run(s, a, start, start + per_stage[layout[s][a.chunk]][a.kind])
                    progress = True
    else:
        _shared(orders, layout, per_stage, ready_at, run, position, float(contention),
                host_of)

    stuck = [
        f"worker {s} at {orders[s][position[s]].format(v > 1)}"
        for s in range(p) if position[s] < len(orders[s])
    ]
    if stuck:
        raise schedule_error(
            sched.name, num_stages, microbatches,
            "deadlock, waiting on a dependency that never runs: " + ", ".join(stuck),
            "make every worker's order run each dependency (F before F downstream, "
            "B/I before B/I upstream, I before W)",
        )
    makespan = max(clock) if clock else 0.0
    total = p * makespan
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        spans=tuple(tuple(worker) for worker in spans),
    )


def _shared(orders: list[list[Action]], layout: list[list[int]],
            per_stage: list[dict[str, float]],
            ready_at: Callable[[int, Action], float | None],
            run: Callable[[int, Action, float, float], None], position: list[int],
            contention: float, host_of: list[Hashable]) -> None:
    """`simulate` with processor sharing: an event loop over action starts (a worker idle
    and its next action's inputs there) and ends (its remaining work done at the rate
    its host's busy workers leave it)."""
    p = len(orders)
    running: list[list[Any] | None] = [None] * p       # [action, start, remaining work]
    now = 0.0
    while True:
        started = True
        while started:                                  # everything that can start now
            started = False
            for s in range(p):
                if running[s] is not None or position[s] >= len(orders[s]):
                    continue
                a = orders[s][position[s]]
                r = ready_at(s, a)
                if r is None or r > now:
                    continue
                work = per_stage[layout[s][a.chunk]][a.kind]
                if work > 0:
                    running[s] = [a, now, work]
                else:
                    run(s, a, now, now)
                    started = True
        busy_on: dict[Hashable, int] = {}
        for s in range(p):
            if running[s] is not None:
                busy_on[host_of[s]] = busy_on.get(host_of[s], 0) + 1
        rate = [1.0 / (1.0 + contention * (busy_on.get(host_of[s], 1) - 1)) for s in range(p)]
        due = {s: now + job[2] / rate[s] for s, job in enumerate(running) if job is not None}
        upcoming = [r for s in range(p) if running[s] is None and position[s] < len(orders[s])
                    for r in (ready_at(s, orders[s][position[s]]),) if r is not None and r > now]
        nxt = min([*due.values(), *upcoming], default=None)
        if nxt is None:
            return                                      # done, or stuck (the caller says)
        for s, t in due.items():
            job = running[s]
            assert job is not None
            if t <= nxt:
                run(s, job[0], job[1], t)
                running[s] = None
            else:
                job[2] -= rate[s] * (nxt - now)
        now = nxt


def _check_cost(name: str, p: object, m: object, label: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise schedule_error(name, p, m, f"cost {label}={value!r} is not a number >= 0",
                             "pass non-negative costs")


def _stage_costs(name: str, p: int, m: int, uniform: Mapping[str, float],
                 given: Mapping[int, Mapping[str, float]] | None, last: int
                 ) -> list[dict[str, float]]:
    """Per global stage, the cost of each action kind (see `simulate`)."""
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise schedule_error(name, p, m, f"stage_costs must be a mapping stage -> "
                             f"{{kind: cost}}, got {type(given).__name__}",
                             "pass e.g. {0: {'F': 1.0, 'B': 2.0}, 1: {...}}")
    outside = sorted((g for g in given
                      if not (isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= last)),
                     key=repr)
    if outside:
        raise schedule_error(name, p, m, f"stage_costs names stage(s) {outside} outside the "
                             f"schedule's global stages 0..{last}",
                             f"key stage_costs by global stage 0..{last}")
    out = []
    for g in range(last + 1):
        sc = given.get(g, {})
        if not isinstance(sc, Mapping):
            raise schedule_error(name, p, m, f"stage_costs[{g}] must map kinds to costs, got "
                                 f"{sc!r}", "pass e.g. {'F': 1.0, 'B': 2.0}")
        unknown = sorted(set(sc) - set(uniform), key=repr)
        if unknown:
            raise schedule_error(name, p, m, f"stage_costs[{g}] has unknown kind(s) {unknown}",
                                 "use the kinds F, B, I, W")
        for kind, value in sc.items():
            _check_cost(name, p, m, f"{kind} of stage {g}", value)
        stage = dict(uniform)
        stage.update({k: float(x) for k, x in sc.items()})
        if "B" not in sc and "I" in sc and "W" in sc:
            stage["B"] = stage["I"] + stage["W"]
        if "B" in sc:
            for kind in ("I", "W"):
                if kind not in sc:
                    stage[kind] = stage["B"] / 2
        out.append(stage)
    return out


def _edge_comm(name: str, p: int, m: int, given: Mapping[tuple[int, int], float] | None,
               last: int) -> dict[tuple[int, int], float]:
    """`edge_comm` checked: (src, dst) global stages -> seconds >= 0."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise schedule_error(name, p, m, f"edge_comm must be a mapping (src, dst) -> cost, "
                             f"got {type(given).__name__}", "pass e.g. {(0, 1): 0.5, (1, 0): 0.5}")
    out = {}
    for edge, value in given.items():
        ok = (isinstance(edge, tuple) and len(edge) == 2
              and all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= last
                      for g in edge))
        if not ok:
            raise schedule_error(name, p, m, f"edge_comm key {edge!r} is not a pair of global "
                                 f"stages in 0..{last}", "key edge_comm by (src, dst) stages")
        _check_cost(name, p, m, f"comm of edge {edge}", value)
        out[edge] = float(value)
    return out


# Schedules with a textbook formula; the others (zb-v, dualpipev, interleaved-zb, user
# schedules) have none that holds for every (p, m) and cost: simulate() them.
_FORMULAS = ("gpipe", "1f1b", "interleaved", "zb-h1", "looped-bfs")
_TAKE_V = ("interleaved", "looped-bfs")


def _name_and_v(name: str | Schedule, v: int | None) -> tuple[str, int]:
    sched = get_schedule(name)
    vs = sched.virtual_stages if v is None else v
    if not is_pos_int(vs):
        raise ScheduleError(f"v must be a positive int, got {vs!r}; fix: pass v >= 1")
    if sched.name not in _FORMULAS:
        raise ScheduleError(
            f"no closed-form formula for schedule {sched.name!r}; fix: use one of "
            f"{', '.join(_FORMULAS)}, or simulate() it"
        )
    return sched.name, vs


def _validated(key: str, vs: int, p: int, m: int) -> None:
    get_schedule(key, **({"virtual_stages": vs} if key in _TAKE_V else {})).validate(p, m)


def ideal_makespan(name: str | Schedule, p: int, m: int, f: float = 1.0, b: float = 2.0,
                   v: int | None = None) -> float:
    """Textbook makespan, no communication; ``v`` defaults to the schedule's virtual stages.

    gpipe, 1f1b: (m + p - 1) * (f + b). interleaved: m * (f + b) + (p - 1) * (f + b) / v.
    zb-h1: m * (f + b) + (p - 1) * f, the paper's (p - 1) * (T_F + T_I - T_W) bubble with
    I = W = b / 2 (3m + p - 1 for F = I = W = 1), but never below the critical path of the
    last microbatch, (m + p - 1) * (f + b / 2) + b / 2, which dominates when m < p
    (2m + 2p - 1 for F = I = W = 1). ZeroBubbleH1 reaches this for F = I = W.
    looped-bfs: (f + b) / v * ((v - 1) * max(m, p) + m + p - 1): each chunk's round of
    forwards (then backwards) takes max(m, p) slots, as the first microbatch needs p of
    them to come back to worker 0; for m >= p it is interleaved's. zb-v, dualpipev and
    interleaved-zb have none here (ScheduleError): simulate() them.
    """
    key, vs = _name_and_v(name, v)
    _validated(key, vs, p, m)
    if key in ("gpipe", "1f1b"):
        return (m + p - 1) * (f + b)
    if key == "interleaved":
        return m * (f + b) + (p - 1) * (f + b) / vs
    if key == "looped-bfs":
        return (f + b) / vs * ((vs - 1) * max(m, p) + m + p - 1)
    return max(m * (f + b) + (p - 1) * f, (m + p - 1) * (f + b / 2) + b / 2)


def bubble_formula(name: str | Schedule, p: int, m: int, v: int | None = None) -> float:
    """Textbook bubble; note the two different denominators.

    gpipe, 1f1b: (p - 1) / (m + p - 1), the idle share of the makespan.
    interleaved: (p - 1) / (v * m), bubble time over ideal compute time m * (f + b)
    (Narayanan et al. 2021); as an idle share of the makespan it is x / (1 + x).
    zb-h1: 1 - 3m / ideal_makespan("zb-h1", p, m), the idle share of the ideal makespan
    for F = I = W; that is (p - 1) / (3m + p - 1) when m >= p.
    looped-bfs: 1 - v * m / ((v - 1) * max(m, p) + m + p - 1), the idle share of its ideal
    makespan, (p - 1) / (v * m + p - 1) when m >= p.
    ``v`` defaults to the schedule's virtual stages.
    """
    key, vs = _name_and_v(name, v)
    _validated(key, vs, p, m)
    if key in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if key == "interleaved":
        return (p - 1) / (vs * m)
    if key == "looped-bfs":
        return 1.0 - vs * m / ((vs - 1) * max(m, p) + m + p - 1)
    return 1.0 - 3 * m / ideal_makespan(key, p, m, 1.0, 2.0)
