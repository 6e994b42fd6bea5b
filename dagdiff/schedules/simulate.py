"""The one schedule simulator (feasibility, makespan, bubble) and the textbook formulas."""
from __future__ import annotations

from dataclasses import dataclass

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
) -> SimResult:
    """Run each worker's actions strictly in order, each as early as dependencies allow.

    Chunk c on worker s is global stage g = ``schedule.stage_layout(p)[s][c]`` (c * p + s
    unless the schedule places its chunks otherwise, e.g. in a V). F at g needs F at g - 1;
    B or I at g needs B or I at g + 1 (the last global stage needs its own F); W needs I at
    the same stage. ``comm`` is added to every dependency whose stage lives on another
    worker (none between the two stages a V layout keeps on one worker). Costs: F = f,
    B = b, I = i and W = w (both default to b / 2), each divided by the number of
    virtual stages. ``bubble_fraction`` = 1 - sum(busy) / (p * makespan).
    """
    sched = get_schedule(schedule)
    orders = sched.table(num_stages, microbatches)
    p, v = num_stages, sched.virtual_stages
    costs = {"F": f, "B": b, "I": b / 2 if i is None else i, "W": b / 2 if w is None else w}
    for label, value in (*costs.items(), ("comm", comm)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise schedule_error(
                sched.name, num_stages, microbatches,
                f"cost {label}={value!r} is not a number >= 0", "pass non-negative costs",
            )
    costs = {kind: cost / v for kind, cost in costs.items()}
    last = p * v - 1
    layout = sched.checked_layout(p)
    worker_of = {g: s for s, stages in enumerate(layout) for g in stages}

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
            start = max(start, t + (comm if worker_of[dg] != s else 0.0))
        return start

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
                end = start + costs[a.kind]
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
                progress = True

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
