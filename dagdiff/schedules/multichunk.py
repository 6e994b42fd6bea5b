"""Schedules with several model chunks per worker: breadth-first looping (LoopedBFS),
interleaved zero bubble (InterleavedZeroBubble) and the two V schedules (ZeroBubbleV,
DualPipeV), whose chunks go down the workers and back up."""
from __future__ import annotations

import collections

from ..errors import ScheduleError
from .action import Action
from .base import Schedule, is_pos_int, schedule_error, v_layout


__all__ = ["LoopedBFS", "InterleavedZeroBubble", "ZeroBubbleV", "DualPipeV",
           "check_virtual_stages"]


def check_virtual_stages(name: str, virtual_stages: object, one_chunk: str) -> int:
    """``virtual_stages`` as an int >= 2, else a ScheduleError naming ``one_chunk``."""
    if not is_pos_int(virtual_stages) or virtual_stages < 2:  # type: ignore[operator]
        raise ScheduleError(
            f"{name!r} schedule: virtual_stages must be an int >= 2, got "
            f"{virtual_stages!r}; fix: pass virtual_stages=2 (or more), or use the "
            f"{one_chunk!r} schedule for one model chunk per worker"
        )
    return virtual_stages  # type: ignore[return-value]


class _Emitter:
    """Builds one worker's order: per (kind, chunk) the next microbatch, and a first-in
    first-out queue of weight-gradient actions still owed for input gradients already run."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self._next: collections.Counter[tuple[str, int]] = collections.Counter()
        self.owed: collections.deque[Action] = collections.deque()

    def count(self, kind: str, chunk: int) -> int:
        return self._next[(kind, chunk)]

    def run(self, kind: str, chunk: int) -> Action:
        """Append ``kind`` (F or I) of the chunk's next microbatch; an I owes its W."""
        mb = self._next[(kind, chunk)]
        self._next[(kind, chunk)] += 1
        action = Action(kind, mb, chunk)
        self.order.append(action)
        if kind == "I":
            self.owed.append(Action("W", mb, chunk))
        return action

    def weight(self, chunk: int | None = None) -> None:
        """Append the oldest W still owed (the oldest of ``chunk`` when given), if any."""
        for n, action in enumerate(self.owed):
            if chunk is None or action.chunk == chunk:
                del self.owed[n]
                self.order.append(action)
                return

    def backward(self, chunk: int) -> None:
        """A full backward of the chunk's next microbatch: its I, then at once its W."""
        self.run("I", chunk)
        self.order.append(self.owed.pop())

    def weights_by_chunk(self, chunks: tuple[int, ...]) -> None:
        """Append every W still owed: those of ``chunks[0]`` first (oldest first), ..."""
        self.order.extend(a for c in chunks for a in self.owed if a.chunk == c)
        self.owed.clear()


class LoopedBFS(Schedule):
    """Breadth-first looped pipeline (Lamy-Poirier 2022, arXiv 2211.05953), as torch's
    ScheduleLoopedBFS runs it.

    Rule: every worker runs, for each of its chunks in order, the forwards of all
    microbatches 0..m-1; then, for each chunk in reverse order, the full backwards of all
    microbatches in reverse order m-1..0 (the last forward's gradient is the first one
    back). Layout: interleaved, chunk c of worker w is global stage c * p + w. Any p >= 1,
    m >= 1 and ``virtual_stages`` >= 2.

    Memory: every forward stays alive until its backward, so each worker peaks at v * m
    (microbatch, chunk) pairs, i.e. m microbatches of its layers as in GPipe. Makespan
    (no communication): (f + b) / v * ((v - 1) * max(m, p) + m + p - 1); for m >= p that is
    m * (f + b) + (p - 1) * (f + b) / v, interleaved 1F1B's.
    """

    name = "looped-bfs"

    def __init__(self, virtual_stages: int = 2) -> None:
        self.virtual_stages = check_virtual_stages(self.name, virtual_stages, "gpipe")

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        m, v = microbatches, self.virtual_stages
        worker = ([Action("F", k, c) for c in range(v) for k in range(m)]
                  + [Action("B", k, c) for c in reversed(range(v)) for k in reversed(range(m))])
        return [list(worker) for _ in range(num_stages)]

    def __repr__(self) -> str:
        return f"LoopedBFS(virtual_stages={self.virtual_stages})"


def _rounds_ok(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


class InterleavedZeroBubble(Schedule):
    """Interleaved 1F1B with the backward split into I and W, whose W's wait like ZB-H1's
    (Qi et al. 2023, arXiv 2401.10241; the order of torch's ScheduleInterleavedZeroBubble).

    Microbatches go in r = max(1, m // p) rounds of g = m / r (g = p when m is a multiple
    of p; g = m when m < p); m must divide into them (m <= p, a multiple of p, or e.g.
    p=4, m=10). Forward k of worker s (k = 0..m*v-1) runs chunk (k // g) % v on microbatch
    (k // (g * v)) * g + k % g; backward k runs the same microbatch on chunk
    v - 1 - (k // g) % v. Worker s runs min((v - 1) * g + p - 1 - s, m * v) warm-up forwards,
    then forward warm-up + k followed by I k for each k, then the remaining I's; after I k
    with k >= s it runs the oldest W still owed (W's lag their I's by s), and the s W's
    left fill the cool-down. Layout: interleaved, chunk c of worker w is global stage
    c * p + w.

    With F = I = W (f = 1, b = 2) and m >= p the makespan is m * (f + b) + (p - 1) * f / v,
    interleaved 1F1B's bubble shrunk by the I/W split. Live (microbatch, chunk) pairs,
    counted until W, peak at p * v per worker when m is a multiple of p (p microbatches of
    a worker's layers, ZB-H1's peak); rounds of g > p microbatches hold more.
    """

    name = "interleaved-zb"
    split_backward = True

    def __init__(self, virtual_stages: int = 2) -> None:
        self.virtual_stages = check_virtual_stages(self.name, virtual_stages, "zb-h1")

    def validate(self, num_stages: int, microbatches: int) -> None:
        super().validate(num_stages, microbatches)
        p, m = num_stages, microbatches
        if not _rounds_ok(p, m):
            lower = next(k for k in range(m - 1, 0, -1) if _rounds_ok(p, k))
            upper = next(k for k in range(m + 1, 2 * m + p) if _rounds_ok(p, k))
            raise schedule_error(
                self.name, p, m,
                f"microbatches must split into max(1, m // p) = {m // p} equal rounds",
                f"use microbatches={lower} or {upper} (any multiple of num_stages works), "
                f"or the 'zb-v' schedule",
            )

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m, v = num_stages, microbatches, self.virtual_stages
        g = m // max(1, m // p)
        total = m * v

        def virtual(k: int, kind: str) -> Action:
            chunk = (k // g) % v
            if kind != "F":
                chunk = v - 1 - chunk
            return Action(kind, (k // (g * v)) * g + k % g, chunk)

        result = []
        for s in range(p):
            warmup = min((v - 1) * g + p - 1 - s, total)
            order = [virtual(k, "F") for k in range(warmup)]
            owed: collections.deque[Action] = collections.deque()
            for k in range(total):
                if warmup + k < total:
                    order.append(virtual(warmup + k, "F"))
                back = virtual(k, "I")
                order.append(back)
                owed.append(Action("W", back.microbatch, back.chunk))
                if k >= s:
                    order.append(owed.popleft())
            order.extend(owed)
            result.append(order)
        return result

    def __repr__(self) -> str:
        return f"InterleavedZeroBubble(virtual_stages={self.virtual_stages})"


class ZeroBubbleV(Schedule):
    """ZB-V (Qi et al. 2023, arXiv 2401.10241, section 6; the order of torch's
    ScheduleZBVZeroBubble): two chunks per worker in a V, backward split into I and W.

    Layout: worker w holds stage w (chunk 0) and stage 2p - 1 - w (chunk 1), so a
    microbatch runs down the workers on chunk 0, turns on the last worker and comes back
    up on chunk 1; the loss is on worker 0. Rule, for worker s and n = max(m, 2p - 1)
    microbatches (the orders for m < 2p - 1 are those for n with the microbatches >= m
    left out):

    1. 2 (p - s) - 1 forwards of chunk 0;
    2. s times: forward chunk 1, forward chunk 0;
    3. p - s times: forward, I, W of chunk 1;
    4. until both chunks have run n forwards: forward chunk 0 (while any is left), I and W
       of chunk 0, then forward, I and W of chunk 1;
    5. s times I chunk 0, I chunk 1 (their W's wait); p - s times I chunk 0 then the
       oldest waiting chunk-0 W; then the waiting chunk-1 W's, then the chunk-0 W's.

    Any p >= 1 and m >= 1. Memory: live (microbatch, chunk) pairs, counted until W, peak
    at 2 * min(p, m) (on the last worker; on every worker once m >= 2p - 1), i.e.
    min(p, m) microbatches of a worker's layers: 1F1B's worst worker. With F = I = W
    (f = 1, b = 2) and m >= 2p - 1 the makespan is m * (f + b) + (p - 1) * f / 2: only
    the last worker's first forward waits, for p - 1 half-stage forwards.
    """

    name = "zb-v"
    split_backward = True
    virtual_stages = 2

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return v_layout(num_workers)

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m = num_stages, microbatches
        n = max(m, 2 * p - 1)
        result = []
        for s in range(p):
            e = _Emitter()
            for _ in range(2 * (p - s) - 1):
                e.run("F", 0)
            for _ in range(s):
                e.run("F", 1)
                e.run("F", 0)
            for _ in range(p - s):
                e.run("F", 1)
                e.backward(1)
            while e.count("F", 1) < n:
                if e.count("F", 0) < n:
                    e.run("F", 0)
                e.backward(0)
                e.run("F", 1)
                e.backward(1)
            for _ in range(s):
                e.run("I", 0)
                e.run("I", 1)
            for _ in range(p - s):
                e.run("I", 0)
                e.weight(0)
            e.weights_by_chunk((1, 0))
            result.append([a for a in e.order if a.microbatch < m])
        return result


class DualPipeV(Schedule):
    """DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 report, arXiv 2412.19437) cut in half,
    two chunks per worker in a V (the order of torch's ScheduleDualPipeV).

    Layout: as ZB-V, worker w holds stage w (chunk 0) and stage 2p - 1 - w (chunk 1).
    DualPipe overlaps the forward of one chunk with the backward of the other; dagdiff has
    no fused action, so an overlapped pair is the forward followed at once by that
    backward. Like torch's, the schedule splits backwards: a full backward is its I followed
    at once by its W (``split_backward`` is set), and only in the cool-down do W's wait, to
    fill the bubble. Rule, for worker s ("B c": I then W of chunk c; "F c + B c'": an
    overlapped pair):

    1. 2 (p - s - 1) forwards of chunk 0;
    2. s + 1 times: forward chunk 0, forward chunk 1;
    3. p - s - 1 times: B 1, forward chunk 1;
    4. m - 2p + s + 1 times: F 0 + B 1, then F 1 + B 0;
    5. p - s - 1 times: B 1, then F 1 + B 0;
    6. s + 1 times: backward chunk 1, backward chunk 0 - the first s + 1 of these 2 (s + 1)
       full, the last s + 1 only I, their W's wait;
    7. p - s - 1 times: the oldest waiting W, then I chunk 0 (its W waits);
    8. the s + 1 W's still waiting, oldest first.

    Needs m >= 2p (as torch's). Memory: live (microbatch, chunk) pairs, counted until W,
    peak at 2p + 1 on worker 0 (p + 1/2 microbatches of a worker's layers, one half-chunk
    above ZB-V). With F = I = W (f = 1, b = 2) the makespan is m * (f + b) + (p - 1) * f / 2.
    """

    name = "dualpipev"
    split_backward = True
    virtual_stages = 2

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return v_layout(num_workers)

    def validate(self, num_stages: int, microbatches: int) -> None:
        super().validate(num_stages, microbatches)
        if microbatches < 2 * num_stages:
            raise schedule_error(
                self.name, num_stages, microbatches,
                f"DualPipeV needs at least 2 * num_stages = {2 * num_stages} microbatches "
                f"(one per global stage)",
                f"use microbatches >= {2 * num_stages}, or the 'zb-v' schedule (any "
                f"microbatches)",
            )

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        p, m = num_stages, microbatches
        result = []
        for s in range(p):
            e = _Emitter()
            for _ in range(2 * (p - s - 1)):
                e.run("F", 0)
            for _ in range(s + 1):
                e.run("F", 0)
                e.run("F", 1)
            for _ in range(p - s - 1):
                e.backward(1)
                e.run("F", 1)
            for _ in range(m - 2 * p + s + 1):
                e.run("F", 0)
                e.backward(1)
                e.run("F", 1)
                e.backward(0)
            for _ in range(p - s - 1):
                e.backward(1)
                e.run("F", 1)
                e.backward(0)
            for j in range(2 * (s + 1)):
                chunk = 1 - j % 2
                if j < s + 1:
                    e.backward(chunk)
                else:
                    e.run("I", chunk)
            for _ in range(p - s - 1):
                e.weight()
                e.run("I", 0)
            while e.owed:
                e.weight()
            result.append(e.order)
        return result
