"""The built-in schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, and from `multichunk`
looped BFS, interleaved zero bubble, ZB-V, DualPipeV) and `get_schedule`."""
from __future__ import annotations

import inspect

from ..errors import ScheduleError
from .action import Action
from .base import Schedule, schedule_error
from .multichunk import (
    DualPipeV,
    InterleavedZeroBubble,
    LoopedBFS,
    ZeroBubbleV,
    check_virtual_stages,
)


__all__ = ["GPipe", "OneFOneB", "Interleaved", "ZeroBubbleH1", "LoopedBFS",
           "InterleavedZeroBubble", "ZeroBubbleV", "DualPipeV", "SCHEDULES", "get_schedule"]


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
        self.virtual_stages = check_virtual_stages(self.name, virtual_stages, "1f1b")

    def validate(self, num_stages: int, microbatches: int) -> None:
        super().validate(num_stages, microbatches)
        if microbatches % num_stages:
            lower = microbatches - microbatches % num_stages
            upper = lower + num_stages
            options = f"microbatches={upper}" + (f" or {lower}" if lower else "")
            raise schedule_error(
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
    LoopedBFS.name: LoopedBFS,
    InterleavedZeroBubble.name: InterleavedZeroBubble,
    ZeroBubbleV.name: ZeroBubbleV,
    DualPipeV.name: DualPipeV,
}

_ALIASES = {
    "zbh1": "zb-h1", "zb_h1": "zb-h1",
    "zbv": "zb-v", "zb_v": "zb-v",
    "dualpipe-v": "dualpipev", "dualpipe_v": "dualpipev",
    "looped_bfs": "looped-bfs", "loopedbfs": "looped-bfs",
    "interleaved_zb": "interleaved-zb", "interleavedzb": "interleaved-zb",
}
_TAKE_VIRTUAL_STAGES = ", ".join(repr(name) for name, cls in SCHEDULES.items()
                                 if "virtual_stages" in inspect.signature(cls).parameters)


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
            f"{', '.join(SCHEDULES)} (also {'/'.join(repr(a) for a in _ALIASES)}), or "
            f"pass a Schedule instance"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ScheduleError(
            f"{key!r} schedule does not accept {sorted(kwargs)}: {exc}; fix: drop them "
            f"(only {_TAKE_VIRTUAL_STAGES} take virtual_stages)"
        ) from None
