"""Pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) as plain data."""

from __future__ import annotations

import collections

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = [
    "ACTION_KINDS",
    "Action",
    "GPipe",
    "Interleaved",
    "OneFOneB",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "ZeroBubbleH1",
    "bubble_formula",
    "get_schedule",
    "ideal_makespan",
    "parse_action",
    "simulate",
]

ACTION_KINDS = ("F", "B", "I", "W")
"""F: forward; B: full backward; I: input-gradient backward; W: weight-gradient backward."""

_ACTION_RE = re.compile(r"^\s*([FBIW])(\d+)(?:\.(\d+))?\s*$")


class ScheduleError(ValueError):
    """Bad arguments for a pipeline schedule (the message says how to fix them)."""


def _schedule_error(name: str, num_stages: object, microbatches: object,
                    problem: str, fix: str) -> ScheduleError:
    return ScheduleError(
        f"{name!r} schedule with num_stages={num_stages!r}, microbatches={microbatches!r}: "
        f"{problem}; fix: {fix}"
    )


def _order_key(a: "Action") -> tuple[int, int, int]:
    return (a.chunk, a.microbatch, "FBIW".index(a.kind))


def _is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclass(frozen=True)
class Action:
    """One unit of work on a worker: ``kind`` of ``microbatch`` on model ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        for field_name in ("microbatch", "chunk"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Action {field_name} must be an int >= 0, got {value!r}")

    def format(self, show_chunk: bool = False) -> str:
        """``"F3"``, or ``"F3.1"`` when ``show_chunk`` is set or the chunk is non-zero."""
        if show_chunk or self.chunk:
            return f"{self.kind}{self.microbatch}.{self.chunk}"
        return f"{self.kind}{self.microbatch}"

    def __str__(self) -> str:
        return self.format()


def parse_action(text: str) -> Action:
    """Parse ``"F3"`` or ``"B2.1"`` (kind, microbatch, optional ``.chunk``) into an Action."""
    match = _ACTION_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected KIND MICROBATCH[.CHUNK] with KIND in "
            f"{'/'.join(ACTION_KINDS)}, e.g. 'F3' or 'B2.1'"
        )
    kind, mb, chunk = match.groups()
    return Action(kind, int(mb), int(chunk) if chunk is not None else 0)


class Schedule(ABC):
    """A pipeline schedule: per worker, the ordered list of actions it executes.

    Subclasses set ``name`` (and ``split_backward`` / ``virtual_stages`` when they
    differ from the defaults) and implement :meth:`orders`.
    """

    name: str = "custom"
    split_backward: bool = False
    virtual_stages: int = 1

    def validate(self, num_stages: int, microbatches: int) -> None:
        """Raise ScheduleError unless both arguments are positive ints."""
        for label, value in (("num_stages", num_stages), ("microbatches", microbatches)):
            if not _is_pos_int(value):
                raise _schedule_error(
                    self.name, num_stages, microbatches,
                    f"{label} must be a positive int, got {value!r}",
                    f"pass {label} as an int >= 1",
                )

    @abstractmethod
    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """Per worker (0-based stage index), the actions in execution order."""

    def _checked_orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        """`orders()` checked: one list per worker, each running every one of its actions
        exactly once (F and B, or F, I and W with ``split_backward``, for each microbatch
        and virtual stage); action strings such as ``"F0"`` are parsed."""
        self.validate(num_stages, microbatches)
        try:
            result = [[a if isinstance(a, Action) else parse_action(a) for a in worker]
                      for worker in self.orders(num_stages, microbatches)]
        except (TypeError, ValueError) as e:
            raise _schedule_error(
                self.name, num_stages, microbatches, f"orders() did not return lists of "
                f"actions ({type(e).__name__}: {e})",
                "return one list of dd.Action (or strings like 'F0', 'B2.1') per worker",
            ) from e
        if len(result) != num_stages:
            raise _schedule_error(
                self.name, num_stages, microbatches,
                f"orders() returned {len(result)} worker lists",
                "return exactly one list of actions per stage from orders()",
            )
        kinds = ("F", "I", "W") if self.split_backward else ("F", "B")
        want = collections.Counter(Action(k, mb, c) for k in kinds
                                   for mb in range(microbatches)
                                   for c in range(self.virtual_stages))
        for w, worker in enumerate(result):
            got = collections.Counter(worker)
            if got != want:
                show = self.virtual_stages > 1
                missing = sorted((want - got).elements(), key=_order_key)
                extra = sorted((got - want).elements(), key=_order_key)
                problem = "; ".join(
                    f"{label} {', '.join(a.format(show) for a in acts[:6])}"
                    f"{' ...' if len(acts) > 6 else ''}"
                    for label, acts in (("is missing", missing), ("has extra", extra)) if acts)
                raise _schedule_error(
                    self.name, num_stages, microbatches, f"worker {w} {problem}",
                    f"each worker runs {'/'.join(kinds)} exactly once per microbatch "
                    f"(0..{microbatches - 1})"
                    + (f" and virtual stage (0..{self.virtual_stages - 1})"
                       if self.virtual_stages > 1 else "")
                    + ("; I and W need split_backward = True on the schedule"
                       if any(a.kind in "IW" for a in extra) and not self.split_backward
                       else ""),
                )
        return result

    def actions(self, num_stages: int, microbatches: int) -> list[list[str]]:
        """Per worker, action strings such as ``"F0"`` (``"F0.1"`` with virtual stages)."""
        show_chunk = self.virtual_stages > 1
        return [
            [a.format(show_chunk) for a in worker]
            for worker in self._checked_orders(num_stages, microbatches)
        ]

    def peak_live(self, num_stages: int, microbatches: int) -> list[int]:
        """Per worker, the most microbatches whose forward state is alive at once.

        F allocates; B frees (W for split-backward schedules: state lives from F until W;
        I frees nothing). With virtual stages each (microbatch, chunk) pair counts once.
        """
        peaks = []
        for worker in self._checked_orders(num_stages, microbatches):
            live = peak = 0
            for a in worker:
                if a.kind == "F":
                    live += 1
                    peak = max(peak, live)
                elif a.kind in ("B", "W"):
                    live -= 1
            peaks.append(peak)
        return peaks

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GPipe(Schedule):
    """GPipe: every worker runs all forwards, then all backwards.

    Both phases go in ascending microbatch order 0..m-1 (as torch.distributed.pipelining's
    ScheduleGPipe does; the GPipe paper's figure drains in reverse order). Under the simple
    cost model both orders give the same makespan and the same peak memory (m).
    """

    name = "gpipe"

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        m = microbatches
        worker = [Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)]
        return [list(worker) for _ in range(num_stages)]


class OneFOneB(Schedule):
    """1F1B (PipeDream-Flush): warm-up forwards, one-backward-one-forward, cool-down.

    Worker s of p runs min(p - s, m) forwards, then alternates B, F until the forwards
    run out, then the remaining backwards. Peak live microbatches on worker s: min(p - s, m).
    """

    name = "1f1b"

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m = num_stages, microbatches
        result = []
        for s in range(p):
            warmup = min(p - s, m)
            order = [Action("F", k) for k in range(warmup)]
            for k in range(m):
                order.append(Action("B", k))
                if warmup + k < m:
                    order.append(Action("F", warmup + k))
            result.append(order)
        return result


class Interleaved(Schedule):
    """Megatron-LM interleaved 1F1B: each worker holds ``virtual_stages`` model chunks.

    Chunk c on worker s is global stage c * p + s. Virtual microbatch k (of m * v) maps to
    microbatch (k // (p * v)) * p + k % p; its forward runs on chunk (k % (p * v)) // p and
    its backward on the reversed chunk v - 1 - that. Worker s runs
    min((p - s - 1) * 2 + (v - 1) * p, m * v) warm-up forwards, then alternates one forward
    and one backward (forward first, as Megatron does), then the cool-down backwards.
    Like Megatron (microbatch group size p), m must be a multiple of p.
    """

    name = "interleaved"

    def __init__(self, virtual_stages: int = 2) -> None:
        if not _is_pos_int(virtual_stages) or virtual_stages < 2:
            raise ScheduleError(
                f"'interleaved' schedule: virtual_stages must be an int >= 2, got "
                f"{virtual_stages!r}; fix: pass virtual_stages=2 (or more), or use the "
                f"'1f1b' schedule for one model chunk per worker"
            )
        self.virtual_stages = virtual_stages

    def validate(self, num_stages: int, microbatches: int) -> None:
        super().validate(num_stages, microbatches)
        if microbatches % num_stages:
            lower = microbatches - microbatches % num_stages
            upper = lower + num_stages
            options = f"microbatches={upper}" + (f" or {lower}" if lower else "")
            raise _schedule_error(
                self.name, num_stages, microbatches,
                "Megatron-LM's interleaved schedule needs microbatches to be a multiple "
                "of num_stages",
                f"use {options}, or the '1f1b' schedule",
            )

    def _virtual(self, p: int, k: int, forward: bool) -> Action:
        v = self.virtual_stages
        group, within = divmod(k, p * v)
        chunk = within // p
        if not forward:
            chunk = v - 1 - chunk
        return Action("F" if forward else "B", group * p + within % p, chunk)

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m, v = num_stages, microbatches, self.virtual_stages
        total = m * v
        forwards = [self._virtual(p, k, True) for k in range(total)]
        backwards = [self._virtual(p, k, False) for k in range(total)]
        result = []
        for s in range(p):
            warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
            order = forwards[:warmup]
            for k in range(total - warmup):
                order.append(forwards[warmup + k])
                order.append(backwards[k])
            order.extend(backwards[total - warmup:])
            result.append(order)
        return result

    def __repr__(self) -> str:
        return f"Interleaved(virtual_stages={self.virtual_stages})"


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): backward split into I and W.

    Worker s of p runs min(p - s, m) warm-up forwards like 1F1B; then for k = 0..m-1 it
    runs I_k, then W_{k-s} once k >= s (W's lag their I's by s), then the next forward if
    any is left; the s W's still pending fill the cool-down. Worker 0 is 1F1B with each
    B split into adjacent I, W; later workers defer W's into the bubble. This is the order
    of the authors' DeepSpeed ZB-H1 (F, B, FB, FBW, BW, W sections).

    With F = I = W = 1 and m >= p the makespan is the paper's 3m + p - 1. Forward state
    held until I peaks at min(p - s, m) per worker, as in 1F1B; held until W (what
    :meth:`peak_live` counts) it peaks at min(p, m) on every worker, i.e. 1F1B's worst
    worker. No order can keep worker s at p - s until W and still reach 3m + p - 1 (the
    last worker would have to run F, I, W strictly in turn). For m < p the same rule gives
    a valid order whose makespan, 2m + 2p - 1, is the in-order critical path.
    """

    name = "zb-h1"
    split_backward = True

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m = num_stages, microbatches
        result = []
        for s in range(p):
            warmup = min(p - s, m)
            order = [Action("F", k) for k in range(warmup)]
            next_f = warmup
            next_w = 0
            for k in range(m):
                order.append(Action("I", k))
                if k >= s:
                    order.append(Action("W", next_w))
                    next_w += 1
                if next_f < m:
                    order.append(Action("F", next_f))
                    next_f += 1
            order.extend(Action("W", j) for j in range(next_w, m))
            result.append(order)
        return result


SCHEDULES: dict[str, type[Schedule]] = {
    GPipe.name: GPipe,
    OneFOneB.name: OneFOneB,
    Interleaved.name: Interleaved,
    ZeroBubbleH1.name: ZeroBubbleH1,
}

_ALIASES = {"zbh1": "zb-h1", "zb_h1": "zb-h1"}


def get_schedule(name_or_schedule: str | Schedule, **kwargs: object) -> Schedule:
    """A Schedule from a name (case-insensitive) or an instance (returned as is)."""
    if isinstance(name_or_schedule, Schedule):
        if kwargs:
            raise ScheduleError(
                f"got a {name_or_schedule!r} instance plus keyword arguments {sorted(kwargs)}; "
                f"fix: pass a schedule name with the keywords, or the instance alone"
            )
        return name_or_schedule
    if not isinstance(name_or_schedule, str):
        raise ScheduleError(
            f"expected a schedule name or Schedule instance, got {name_or_schedule!r}; "
            f"fix: use one of {', '.join(SCHEDULES)}"
        )
    key = name_or_schedule.strip().lower()
    key = _ALIASES.get(key, key)
    cls = SCHEDULES.get(key)
    if cls is None:
        raise ScheduleError(
            f"unknown schedule {name_or_schedule!r}; fix: use one of "
            f"{', '.join(SCHEDULES)} (also 'zbh1'/'zb_h1'), or pass a Schedule instance"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ScheduleError(
            f"{key!r} schedule does not accept {sorted(kwargs)}: {exc}; fix: drop them "
            f"(only 'interleaved' takes virtual_stages)"
        ) from None


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

    Chunk c on worker s is global stage g = c * p + s. F at g needs F at g - 1; B or I at g
    needs B or I at g + 1 (the last global stage needs its own F); W needs I at the same
    stage. ``comm`` is added to every dependency that crosses workers. Costs: F = f,
    B = b, I = i and W = w (both default to b / 2), each divided by the number of
    virtual stages. ``bubble_fraction`` = 1 - sum(busy) / (p * makespan).
    """
    sched = get_schedule(schedule)
    orders = sched._checked_orders(num_stages, microbatches)
    p, v = num_stages, sched.virtual_stages
    costs = {"F": f, "B": b, "I": b / 2 if i is None else i, "W": b / 2 if w is None else w}
    for label, value in (*costs.items(), ("comm", comm)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise _schedule_error(
                sched.name, num_stages, microbatches,
                f"cost {label}={value!r} is not a number >= 0", "pass non-negative costs",
            )
    costs = {kind: cost / v for kind, cost in costs.items()}
    last = p * v - 1

    for s, worker in enumerate(orders):
        seen: set[Action] = set()
        for a in worker:
            if a.chunk >= v or a in seen or a.microbatch >= microbatches:
                raise _schedule_error(
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
        g = a.chunk * p + s
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
            start = max(start, t + (comm if dg % p != s else 0.0))
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
                g = a.chunk * p + s
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
        raise _schedule_error(
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


def _name_and_v(name: str | Schedule, v: int | None) -> tuple[str, int]:
    sched = get_schedule(name)
    vs = sched.virtual_stages if v is None else v
    if not _is_pos_int(vs):
        raise ScheduleError(f"v must be a positive int, got {vs!r}; fix: pass v >= 1")
    if sched.name not in SCHEDULES:
        raise ScheduleError(
            f"no closed-form formula for schedule {sched.name!r}; fix: use one of "
            f"{', '.join(SCHEDULES)}, or simulate() it"
        )
    return sched.name, vs


def ideal_makespan(name: str | Schedule, p: int, m: int, f: float = 1.0, b: float = 2.0,
                   v: int | None = None) -> float:
    """Textbook makespan, no communication; ``v`` defaults to the schedule's virtual stages.

    gpipe, 1f1b: (m + p - 1) * (f + b). interleaved: m * (f + b) + (p - 1) * (f + b) / v.
    zb-h1: m * (f + b) + (p - 1) * f, the paper's (p - 1) * (T_F + T_I - T_W) bubble with
    I = W = b / 2 (3m + p - 1 for F = I = W = 1), but never below the critical path of the
    last microbatch, (m + p - 1) * (f + b / 2) + b / 2, which dominates when m < p
    (2m + 2p - 1 for F = I = W = 1). ZeroBubbleH1 reaches this for F = I = W.
    """
    key, vs = _name_and_v(name, v)
    get_schedule(key, **({"virtual_stages": vs} if key == "interleaved" else {})).validate(p, m)
    if key in ("gpipe", "1f1b"):
        return (m + p - 1) * (f + b)
    if key == "interleaved":
        return m * (f + b) + (p - 1) * (f + b) / vs
    return max(m * (f + b) + (p - 1) * f, (m + p - 1) * (f + b / 2) + b / 2)


def bubble_formula(name: str | Schedule, p: int, m: int, v: int | None = None) -> float:
    """Textbook bubble; note the two different denominators.

    gpipe, 1f1b: (p - 1) / (m + p - 1), the idle share of the makespan.
    interleaved: (p - 1) / (v * m), bubble time over ideal compute time m * (f + b)
    (Narayanan et al. 2021); as an idle share of the makespan it is x / (1 + x).
    zb-h1: 1 - 3m / ideal_makespan("zb-h1", p, m), the idle share of the ideal makespan
    for F = I = W; that is (p - 1) / (3m + p - 1) when m >= p.
    ``v`` defaults to the schedule's virtual stages.
    """
    key, vs = _name_and_v(name, v)
    get_schedule(key, **({"virtual_stages": vs} if key == "interleaved" else {})).validate(p, m)
    if key in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if key == "interleaved":
        return (p - 1) / (vs * m)
    return 1.0 - 3 * m / ideal_makespan(key, p, m, 1.0, 2.0)
