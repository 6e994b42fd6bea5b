"""Tests for the multi-chunk schedules (looped-bfs, interleaved-zb, zb-v, dualpipev), stage
layouts, and a comparison with torch.distributed.pipelining's orders (skipped without torch).

Needs neither jax nor dask: dagdiff.schedules is pure data."""

from __future__ import annotations

import types
from collections import Counter

import pytest

from dagdiff.schedules import (
    SCHEDULES,
    Action,
    DualPipeV,
    GPipe,
    Interleaved,
    InterleavedZeroBubble,
    LoopedBFS,
    OneFOneB,
    Schedule,
    ScheduleError,
    ZeroBubbleH1,
    ZeroBubbleV,
    bubble_formula,
    get_schedule,
    ideal_makespan,
    interleaved_layout,
    parse_action,
    simulate,
    v_layout,
)

NEW = ("looped-bfs", "interleaved-zb", "zb-v", "dualpipev")
SPLIT_COSTS = dict(f=1, b=2, i=1, w=1)


def rows(*lines: str) -> list[list[str]]:
    return [line.split() for line in lines]


# ---------------------------------------------------------------------------------------
# Literal tables, worked out by hand from each schedule's rule (worker 0 first); the
# derivations are in the comments. Where torch has the schedule, test_orders_equal_torchs
# below checks the same orders against torch's (these four tables included).

# LoopedBFS: every worker runs all forwards chunk by chunk, then all backwards with the
# chunks and the microbatches reversed.
BFS_P1_M1_V2 = rows("F0.0 F0.1 B0.1 B0.0")
BFS_P2_M3_V2 = rows(
    "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B2.1 B1.1 B0.1 B2.0 B1.0 B0.0",
    "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B2.1 B1.1 B0.1 B2.0 B1.0 B0.0",
)
BFS_P2_M2_V3 = rows(
    "F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 B1.2 B0.2 B1.1 B0.1 B1.0 B0.0",
    "F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 B1.2 B0.2 B1.1 B0.1 B1.0 B0.0",
)

# InterleavedZeroBubble. p=1, m=1: group g = 1, warm-up min(1*1 + 0, 2) = 1 (F0.0); k=0:
# forward 1 = F0.1, I0.1, W0.1 (k >= s = 0); k=1: I0.0, W0.0.
IZB_P1_M1 = rows("F0.0 F0.1 I0.1 W0.1 I0.0 W0.0")
# p=2, m=4: g = 4 // 2 = 2; forwards F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 F2.1 F3.1, backwards
# I0.1 I1.1 I0.0 I1.0 I2.1 I3.1 I2.0 I3.0. Worker 0: warm-up 2 + 1 = 3, W right after
# each I. Worker 1: warm-up 2, each W one I late, W3.0 last.
IZB_P2_M4 = rows(
    "F0.0 F1.0 F0.1 F1.1 I0.1 W0.1 F2.0 I1.1 W1.1 F3.0 I0.0 W0.0 "
    "F2.1 I1.0 W1.0 F3.1 I2.1 W2.1 I3.1 W3.1 I2.0 W2.0 I3.0 W3.0",
    "F0.0 F1.0 F0.1 I0.1 F1.1 I1.1 W0.1 F2.0 I0.0 W1.1 F3.0 I1.0 "
    "W0.0 F2.1 I2.1 W1.0 F3.1 I3.1 W2.1 I2.0 W3.1 I3.0 W2.0 W3.0",
)
# p=3, m=2 (m < p): g = m = 2; forwards F0.0 F1.0 F0.1 F1.1, backwards I0.1 I1.1 I0.0
# I1.0; warm-ups min(2 + 2 - s, 4) = 4, 3, 2; W's lag their I's by s = 0, 1, 2.
IZB_P3_M2 = rows(
    "F0.0 F1.0 F0.1 F1.1 I0.1 W0.1 I1.1 W1.1 I0.0 W0.0 I1.0 W1.0",
    "F0.0 F1.0 F0.1 F1.1 I0.1 I1.1 W0.1 I0.0 W1.1 I1.0 W0.0 W1.0",
    "F0.0 F1.0 F0.1 I0.1 F1.1 I1.1 I0.0 W0.1 I1.0 W1.1 W0.0 W1.0",
)

# ZB-V (chunk 0 = stage s, chunk 1 = stage 2p-1-s). p=1, m=1: n = 1; 1 forward of chunk
# 0; 1 x (F, I, W of chunk 1); the steady loop is done; 1 x (I chunk 0, W chunk 0).
ZBV_P1_M1 = rows("F0.0 F0.1 I0.1 W0.1 I0.0 W0.0")
# p=2, m=1: built for n = 3, then microbatches 1 and 2 dropped; both workers keep
# F0.0 F0.1 I0.1 W0.1 I0.0 W0.0.
ZBV_P2_M1 = rows("F0.0 F0.1 I0.1 W0.1 I0.0 W0.0", "F0.0 F0.1 I0.1 W0.1 I0.0 W0.0")
# p=2, m=4 (n = 4). Worker 0: F0.0 F1.0 F2.0 | (F I W chunk 1) x2 | steady: F3.0 I0.0 W0.0
# F2.1 I2.1 W2.1, I1.0 W1.0 F3.1 I3.1 W3.1 | cool-down: I2.0 W2.0 I3.0 W3.0.
# Worker 1: F0.0 | F0.1 F1.0 | F1.1 I0.1 W0.1 | steady: F2.0 I0.0 W0.0 F2.1 I1.1 W1.1,
# F3.0 I1.0 W1.0 F3.1 I2.1 W2.1 | I2.0 I3.1 | I3.0 W2.0 | W3.1 | W3.0.
ZBV_P2_M4 = rows(
    "F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F3.0 I0.0 W0.0 "
    "F2.1 I2.1 W2.1 I1.0 W1.0 F3.1 I3.1 W3.1 I2.0 W2.0 I3.0 W3.0",
    "F0.0 F0.1 F1.0 F1.1 I0.1 W0.1 F2.0 I0.0 W0.0 F2.1 I1.1 W1.1 "
    "F3.0 I1.0 W1.0 F3.1 I2.1 W2.1 I2.0 I3.1 I3.0 W2.0 W3.1 W3.0",
)
# p=3, m=3: built for n = 5, microbatches 3 and 4 dropped. E.g. worker 2 for n = 5:
# F0.0 | F0.1 F1.0 F1.1 F2.0 | F2.1 I0.1 W0.1 | F3.0 I0.0 W0.0 F3.1 I1.1 W1.1 F4.0 I1.0
# W1.0 F4.1 I2.1 W2.1 | I2.0 I3.1 I3.0 I4.1 | I4.0 W2.0 | W3.1 W4.1 | W3.0 W4.0.
ZBV_P3_M3 = rows(
    "F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F2.1 I2.1 W2.1 I0.0 W0.0 I1.0 W1.0 "
    "I2.0 W2.0",
    "F0.0 F1.0 F2.0 F0.1 F1.1 I0.1 W0.1 F2.1 I1.1 W1.1 I0.0 W0.0 I2.1 W2.1 I1.0 W1.0 "
    "I2.0 W2.0",
    "F0.0 F0.1 F1.0 F1.1 F2.0 F2.1 I0.1 W0.1 I0.0 W0.0 I1.1 W1.1 I1.0 W1.0 I2.1 W2.1 "
    "I2.0 W2.0",
)

# DualPipeV (a full backward = I then W at once; overlapped pair = F then that backward).
# p=1, m=2: step 2: F0.0 F0.1; step 4 (1x): F1.0 + B0.1, F1.1 + B0.0; step 6: B1.1 in
# full, I1.0 alone; step 8: W1.0.
DPV_P1_M2 = rows("F0.0 F0.1 F1.0 I0.1 W0.1 F1.1 I0.0 W0.0 I1.1 W1.1 I1.0 W1.0")
# p=2, m=4. Worker 0: F0.0 F1.0 | F2.0 F0.1 | B0.1 F1.1 | F3.0+B1.1, F2.1+B0.0 |
# B2.1, F3.1+B1.0 | B3.1, I2.0 | W2.0 I3.0 | W3.0.
# Worker 1: F0.0 F0.1 F1.0 F1.1 | (F2.0+B0.1, F2.1+B0.0), (F3.0+B1.1, F3.1+B1.0) |
# B2.1 B2.0 I3.1 I3.0 | W3.1 W3.0.
DPV_P2_M4 = rows(
    "F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 F3.0 I1.1 W1.1 F2.1 I0.0 W0.0 I2.1 W2.1 F3.1 "
    "I1.0 W1.0 I3.1 W3.1 I2.0 W2.0 I3.0 W3.0",
    "F0.0 F0.1 F1.0 F1.1 F2.0 I0.1 W0.1 F2.1 I0.0 W0.0 F3.0 I1.1 W1.1 F3.1 I1.0 W1.0 "
    "I2.1 W2.1 I2.0 W2.0 I3.1 I3.0 W3.1 W3.0",
)
# p=2, m=5: step 4 runs m - 2p + s + 1 = 2 (worker 0) and 3 (worker 1) times.
DPV_P2_M5 = rows(
    "F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 F3.0 I1.1 W1.1 F2.1 I0.0 W0.0 F4.0 I2.1 W2.1 "
    "F3.1 I1.0 W1.0 I3.1 W3.1 F4.1 I2.0 W2.0 I4.1 W4.1 I3.0 W3.0 I4.0 W4.0",
    "F0.0 F0.1 F1.0 F1.1 F2.0 I0.1 W0.1 F2.1 I0.0 W0.0 F3.0 I1.1 W1.1 F3.1 I1.0 W1.0 "
    "F4.0 I2.1 W2.1 F4.1 I2.0 W2.0 I3.1 W3.1 I3.0 W3.0 I4.1 I4.0 W4.1 W4.0",
)

TABLES = [
    ("bfs-1-1", LoopedBFS(), 1, 1, BFS_P1_M1_V2),
    ("bfs-2-3", LoopedBFS(), 2, 3, BFS_P2_M3_V2),
    ("bfs-2-2-v3", LoopedBFS(3), 2, 2, BFS_P2_M2_V3),
    ("izb-1-1", InterleavedZeroBubble(), 1, 1, IZB_P1_M1),
    ("izb-2-4", InterleavedZeroBubble(), 2, 4, IZB_P2_M4),
    ("izb-3-2", InterleavedZeroBubble(), 3, 2, IZB_P3_M2),
    ("zbv-1-1", ZeroBubbleV(), 1, 1, ZBV_P1_M1),
    ("zbv-2-1", ZeroBubbleV(), 2, 1, ZBV_P2_M1),
    ("zbv-2-4", ZeroBubbleV(), 2, 4, ZBV_P2_M4),
    ("zbv-3-3", ZeroBubbleV(), 3, 3, ZBV_P3_M3),
    ("dpv-1-2", DualPipeV(), 1, 2, DPV_P1_M2),
    ("dpv-2-4", DualPipeV(), 2, 4, DPV_P2_M4),
    ("dpv-2-5", DualPipeV(), 2, 5, DPV_P2_M5),
]


@pytest.mark.parametrize("schedule, p, m, expected", [t[1:] for t in TABLES],
                         ids=[t[0] for t in TABLES])
def test_literal_tables(schedule: Schedule, p: int, m: int, expected: list[list[str]]) -> None:
    assert schedule.actions(p, m) == expected


# ---------------------------------------------------------------------------------------
# Every allowed (p, m): each action once per worker, in a dependency-respecting order,
# and simulate() finishes (no deadlock).

def _allowed(schedule: Schedule, p: int, m: int) -> bool:
    try:
        schedule.validate(p, m)
    except ScheduleError:
        return False
    return True


def _grid() -> list[tuple[Schedule, int, int]]:
    cases = []
    for sched in (LoopedBFS(), LoopedBFS(3), InterleavedZeroBubble(), InterleavedZeroBubble(3),
                  ZeroBubbleV(), DualPipeV()):
        for p in (1, 2, 3, 4, 5, 6, 8):
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 17, 24):
                if _allowed(sched, p, m):
                    cases.append((sched, p, m))
    return cases


@pytest.mark.parametrize("schedule, p, m", _grid())
def test_every_action_once_and_no_deadlock(schedule: Schedule, p: int, m: int) -> None:
    v = schedule.virtual_stages
    kinds = ("F", "I", "W") if schedule.split_backward else ("F", "B")
    want = Counter((k, mb, c) for k in kinds for mb in range(m) for c in range(v))
    table = schedule.actions(p, m)
    assert len(table) == p
    for worker in table:
        parsed = [parse_action(text) for text in worker]
        assert Counter((a.kind, a.microbatch, a.chunk) for a in parsed) == want
        pos = {(a.kind, a.microbatch, a.chunk): n for n, a in enumerate(parsed)}
        back = "I" if schedule.split_backward else "B"
        for mb in range(m):
            for c in range(v):
                assert pos[("F", mb, c)] < pos[(back, mb, c)]
                if schedule.split_backward:
                    assert pos[("I", mb, c)] < pos[("W", mb, c)]
    res = simulate(schedule, p, m, **SPLIT_COSTS)
    assert [len(spans) for spans in res.spans] == [len(w) for w in table]
    assert [[name for name, _, _ in spans] for spans in res.spans] == table
    assert res.busy == pytest.approx((m * 3.0,) * p)
    simulate(schedule, p, m, comm=0.3)  # with communication too


def test_allowed_grid_is_not_empty() -> None:
    names = Counter(s.name for s, _, _ in _grid())
    assert set(names) == set(NEW) and min(names.values()) > 40


# ---------------------------------------------------------------------------------------
# The makespans and peaks the docstrings promise (F = I = W = 1, B = 2).

@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 11, 12, 16])
def test_documented_makespan_and_peak(p: int, m: int) -> None:
    zbv = simulate("zb-v", p, m, **SPLIT_COSTS)
    zbv_peak = ZeroBubbleV().peak_live(p, m)
    assert max(zbv_peak) == 2 * min(p, m) == zbv_peak[-1]
    if m >= 2 * p - 1:
        assert zbv.makespan == pytest.approx(3 * m + (p - 1) / 2)
        assert zbv_peak == [2 * p] * p        # 1F1B's worst worker, on every worker
    if m >= 2 * p:
        dpv = simulate("dualpipev", p, m, **SPLIT_COSTS)
        assert dpv.makespan == pytest.approx(3 * m + (p - 1) / 2)
        dpv_peak = DualPipeV().peak_live(p, m)
        assert dpv_peak[0] == max(dpv_peak) == 2 * p + 1
    for v in (2, 3):
        bfs = LoopedBFS(v)
        assert bfs.peak_live(p, m) == [v * m] * p
        assert simulate(bfs, p, m, f=1, b=2).makespan == pytest.approx(
            3 / v * ((v - 1) * max(m, p) + m + p - 1))
        izb = InterleavedZeroBubble(v)
        if _allowed(izb, p, m):
            res = simulate(izb, p, m, **SPLIT_COSTS)
            if m >= p:
                assert res.makespan == pytest.approx(3 * m + (p - 1) / v)
            if m % p == 0:
                assert izb.peak_live(p, m) == [p * v] * p


def test_zero_bubble_schedules_beat_their_parents() -> None:
    for p, m in [(4, 8), (4, 16), (8, 16)]:
        assert (simulate("zb-v", p, m, **SPLIT_COSTS).makespan
                < simulate("zb-h1", p, m, **SPLIT_COSTS).makespan
                < simulate("1f1b", p, m, f=1, b=2).makespan)
        assert (simulate("interleaved-zb", p, m, **SPLIT_COSTS).makespan
                < simulate("interleaved", p, m, f=1, b=2).makespan)
        # looped BFS: interleaved's makespan for m >= p, GPipe's memory
        assert simulate("looped-bfs", p, m).makespan == pytest.approx(
            simulate("interleaved", p, m).makespan)
        assert LoopedBFS().peak_live(p, m) == [2 * m] * p


# ---------------------------------------------------------------------------------------
# Formulas: looped-bfs has one; the other three ask to be simulated.

@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13])
@pytest.mark.parametrize("v", [2, 3])
def test_looped_bfs_formula(p: int, m: int, v: int) -> None:
    res = simulate(LoopedBFS(v), p, m, f=1.5, b=2.5)
    assert ideal_makespan("looped-bfs", p, m, f=1.5, b=2.5, v=v) == pytest.approx(res.makespan)
    assert bubble_formula("looped-bfs", p, m, v=v) == pytest.approx(res.bubble_fraction)
    default = simulate(LoopedBFS(v), p, m)
    assert ideal_makespan(LoopedBFS(v), p, m) == pytest.approx(default.makespan)
    if m >= p:
        assert bubble_formula("looped-bfs", p, m, v=v) == pytest.approx((p - 1) / (v * m + p - 1))
        if m % p == 0:
            assert ideal_makespan("looped-bfs", p, m, v=v) == pytest.approx(
                ideal_makespan("interleaved", p, m, v=v))


@pytest.mark.parametrize("name", ["zb-v", "dualpipev", "interleaved-zb"])
def test_no_formula_for_the_others(name: str) -> None:
    for func in (ideal_makespan, bubble_formula):
        with pytest.raises(ScheduleError) as err:
            func(name, 2, 4)
        msg = str(err.value)
        assert "no closed-form formula" in msg and name in msg and "simulate()" in msg
        assert "fix:" in msg


# ---------------------------------------------------------------------------------------
# Constraints, construction, registry.

def test_constraint_errors() -> None:
    with pytest.raises(ScheduleError) as err:
        DualPipeV().actions(3, 5)
    msg = str(err.value)
    assert "dualpipev" in msg and "microbatches >= 6" in msg and "zb-v" in msg
    DualPipeV().actions(3, 6)
    with pytest.raises(ScheduleError) as err:
        InterleavedZeroBubble().actions(2, 5)       # 2 rounds of 2.5
    msg = str(err.value)
    assert "interleaved-zb" in msg and "microbatches=4 or 6" in msg and "fix:" in msg
    with pytest.raises(ScheduleError, match="microbatches=8 or 10"):
        simulate("interleaved-zb", 4, 9)
    InterleavedZeroBubble().actions(4, 10)          # 2 rounds of 5: allowed, as in torch
    InterleavedZeroBubble().actions(4, 3)           # m < p: one round of 3
    for cls in (LoopedBFS, InterleavedZeroBubble):
        for bad in (1, 0, 2.0, True, "2"):
            with pytest.raises(ScheduleError, match="virtual_stages"):
                cls(bad)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="'gpipe'"):
        LoopedBFS(1)
    with pytest.raises(ScheduleError, match="'zb-h1'"):
        InterleavedZeroBubble(1)
    for sched in (ZeroBubbleV(), DualPipeV(), LoopedBFS(), InterleavedZeroBubble()):
        with pytest.raises(ScheduleError, match="fix"):
            sched.actions(0, 4)


def test_registry_and_get_schedule() -> None:
    assert set(NEW) <= set(SCHEDULES)
    assert {"gpipe", "1f1b", "interleaved", "zb-h1"} <= set(SCHEDULES)
    for name, cls in [("looped-bfs", LoopedBFS), ("interleaved-zb", InterleavedZeroBubble),
                      ("zb-v", ZeroBubbleV), ("dualpipev", DualPipeV)]:
        assert SCHEDULES[name] is cls and cls.name == name
        assert isinstance(get_schedule(name), cls)
        assert isinstance(get_schedule(name.upper()), cls)
    for alias, cls in [("ZBV", ZeroBubbleV), ("zb_v", ZeroBubbleV), ("DualPipe-V", DualPipeV),
                       ("looped_bfs", LoopedBFS), ("interleaved_zb", InterleavedZeroBubble)]:
        assert isinstance(get_schedule(alias), cls)
    assert get_schedule("looped-bfs", virtual_stages=3).virtual_stages == 3
    assert get_schedule("interleaved-zb", virtual_stages=4).virtual_stages == 4
    with pytest.raises(ScheduleError) as err:
        get_schedule("zb-v", virtual_stages=3)
    assert "'looped-bfs'" in str(err.value) and "'interleaved-zb'" in str(err.value)
    with pytest.raises(ScheduleError) as err:
        get_schedule("dualpipe")
    for name in NEW:
        assert name in str(err.value)
    assert ZeroBubbleV.split_backward and DualPipeV.split_backward
    assert InterleavedZeroBubble.split_backward and not LoopedBFS.split_backward
    assert ZeroBubbleV().virtual_stages == DualPipeV().virtual_stages == 2
    assert repr(LoopedBFS(3)) == "LoopedBFS(virtual_stages=3)"
    assert repr(InterleavedZeroBubble()) == "InterleavedZeroBubble(virtual_stages=2)"
    for cls in (LoopedBFS, InterleavedZeroBubble, ZeroBubbleV, DualPipeV):
        assert cls.__doc__ and "Layout" in cls.__doc__ and "akespan" in cls.__doc__


# ---------------------------------------------------------------------------------------
# Stage layouts.

@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_stage_layouts(p: int) -> None:
    for sched in (GPipe(), OneFOneB(), ZeroBubbleH1()):
        assert sched.stage_layout(p) == [[w] for w in range(p)]
    for v in (2, 3):
        for sched in (Interleaved(v), LoopedBFS(v), InterleavedZeroBubble(v)):
            assert sched.stage_layout(p) == [[c * p + w for c in range(v)] for w in range(p)]
            assert sched.stage_layout(p) == interleaved_layout(p, v)
    for sched in (ZeroBubbleV(), DualPipeV()):
        assert sched.stage_layout(p) == [[w, 2 * p - 1 - w] for w in range(p)]
        assert sched.stage_layout(p) == v_layout(p)
    assert v_layout(3) == [[0, 5], [1, 4], [2, 3]]
    assert interleaved_layout(3, 2) == [[0, 3], [1, 4], [2, 5]]


def test_v_turn_pays_no_communication() -> None:
    # zb-v, p=2, m=1, comm=1 (chunk F = 0.5): stage 0 on worker 0 runs [0, 0.5]; stage 1 on
    # worker 1 waits for it plus comm, [1.5, 2]; stage 2 is on worker 1 too: [2, 2.5], no
    # comm; stage 3 is back on worker 0: [3.5, 4].
    res = simulate("zb-v", 2, 1, f=1, b=2, i=1, w=1, comm=1.0)
    assert res.spans[0][:2] == (("F0.0", 0.0, 0.5), ("F0.1", 3.5, 4.0))
    assert res.spans[1][:2] == (("F0.0", 1.5, 2.0), ("F0.1", 2.0, 2.5))
    # with one worker nothing ever crosses
    assert (simulate("zb-v", 1, 4, comm=5.0).makespan
            == simulate("zb-v", 1, 4).makespan == pytest.approx(12.0))


class Contiguous(Schedule):
    """Worker w holds the consecutive stages 2w and 2w + 1; depth-first order."""

    name = "contiguous"
    virtual_stages = 2

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return [[2 * w, 2 * w + 1] for w in range(num_workers)]

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        self.validate(num_stages, microbatches)
        m = microbatches
        order = ([Action("F", k, c) for k in range(m) for c in (0, 1)]
                 + [Action("B", k, c) for k in range(m) for c in (1, 0)])
        return [list(order) for _ in range(num_stages)]


def test_custom_layout_simulates_by_its_layout() -> None:
    sched = Contiguous()
    assert sched.actions(2, 2) == rows("F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0",
                                       "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0")
    # By hand, f = 1, b = 2 -> 0.5 and 1 per chunk. Worker 0 (stages 0, 1) runs its
    # forwards back to back, [0, 2]. Worker 1 (stages 2, 3): F0.0 needs stage 1 of mb 0
    # (done at 1): [1, 1.5], F0.1 [1.5, 2], F1.0 needs stage 1 of mb 1 (2): [2, 2.5],
    # F1.1 [2.5, 3], B0.1 [3, 4], B0.0 [4, 5], B1.1 [5, 6], B1.0 [6, 7]. Worker 0: B0.1
    # (stage 1) needs stage 2's B of mb 0 (5): [5, 6], B0.0 [6, 7], B1.1 needs 7: [7, 8],
    # B1.0 [8, 9].
    res = simulate(sched, 2, 2, f=1, b=2)
    assert res.spans[0] == (("F0.0", 0.0, 0.5), ("F0.1", 0.5, 1.0), ("F1.0", 1.0, 1.5),
                            ("F1.1", 1.5, 2.0), ("B0.1", 5.0, 6.0), ("B0.0", 6.0, 7.0),
                            ("B1.1", 7.0, 8.0), ("B1.0", 8.0, 9.0))
    assert res.spans[1] == (("F0.0", 1.0, 1.5), ("F0.1", 1.5, 2.0), ("F1.0", 2.0, 2.5),
                            ("F1.1", 2.5, 3.0), ("B0.1", 3.0, 4.0), ("B0.0", 4.0, 5.0),
                            ("B1.1", 5.0, 6.0), ("B1.0", 6.0, 7.0))
    assert res.makespan == 9.0
    assert sched.peak_live(2, 2) == [4, 4]
    # only stages 1 and 2 are on different workers: microbatch 1's forward and backward
    # each cross once on the critical path
    assert simulate(sched, 2, 2, f=1, b=2, comm=0.25).makespan == pytest.approx(9.5)
    # The same orders on the default layout [[0, 2], [1, 3]] (stage 1 of mb 1 waits for
    # worker 1's F0.1, and so on): by hand the makespan is 10.5.
    assert DefaultLayout().stage_layout(2) == [[0, 2], [1, 3]]
    assert simulate(DefaultLayout(), 2, 2, f=1, b=2).makespan == pytest.approx(10.5)


class DefaultLayout(Contiguous):
    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return Schedule.stage_layout(self, num_workers)


class ChunkOneFirst(Schedule):
    """On every worker: F of chunk 1, F of chunk 0, B of chunk 0, B of chunk 1."""

    name = "chunk-one-first"
    virtual_stages = 2

    def __init__(self, layout: list[list[int]]) -> None:
        self.layout = layout

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return self.layout

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        order = [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)]
        return [list(order) for _ in range(num_stages)]


def test_layout_decides_feasibility() -> None:
    # Layout [[3, 0], [1, 2]]: worker 1 starts with stage 2 (its chunk 1), which needs
    # stage 1, its own chunk 0, which comes later: deadlock.
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(ChunkOneFirst([[3, 0], [1, 2]]), 2, 1)
    # Layout [[1, 0], [3, 2]]: chunk 1 is the earlier stage on each worker. By hand
    # (0.5 per F, 1 per B): stages 0, 1 on worker 0 [0, 1], stages 2, 3 on worker 1 [1, 2],
    # B of stage 3 then 2 on worker 1 [2, 4], B of stage 1 then 0 on worker 0 [4, 6].
    res = simulate(ChunkOneFirst([[1, 0], [3, 2]]), 2, 1, f=1, b=2)
    assert res.spans == ((("F0.1", 0.0, 0.5), ("F0.0", 0.5, 1.0), ("B0.0", 4.0, 5.0),
                          ("B0.1", 5.0, 6.0)),
                         (("F0.1", 1.0, 1.5), ("F0.0", 1.5, 2.0), ("B0.0", 2.0, 3.0),
                          ("B0.1", 3.0, 4.0)))


def _bad_layout_schedule(layout: object) -> Schedule:
    class Bad(GPipe):
        name = "bad-layout"
        virtual_stages = 2

        def stage_layout(self, num_workers: int) -> list[list[int]]:
            return layout  # type: ignore[return-value]

        def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
            return LoopedBFS().orders(num_stages, microbatches)

    return Bad()


@pytest.mark.parametrize("layout, problem", [
    ([[0, 2]], "1 worker lists"),                       # one worker list for two workers
    ([[0, 2], [1]], "1 chunk(s)"),                      # a chunk missing
    ([[0, 2, 4], [1, 3]], "3 chunk(s)"),                # a chunk too many
    ([[0, 2], [2, 3]], "repeats stage(s) [2]"),
    ([[0, 2], [1, 4]], "out of range [4]"),
    ([[0, 1], [1, 2]], "lacks stage(s) [3]"),
    ([[0, 2], [1, "3"]], "non-int"),
    ([[0, 2], [1, True]], "non-int"),
    (None, "did not return lists"),
])
def test_bad_layouts_raise(layout: object, problem: str) -> None:
    sched = _bad_layout_schedule(layout)
    for call in (lambda: sched.actions(2, 2), lambda: sched.peak_live(2, 2),
                 lambda: simulate(sched, 2, 2)):
        with pytest.raises(ScheduleError) as err:
            call()
        msg = str(err.value)
        assert problem in msg and "stage_layout" in msg and "fix:" in msg
        assert "bad-layout" in msg and "[[0, 2], [1, 3]]" in msg   # the fix shows a layout


@pytest.mark.parametrize("sched, p, m", [(OneFOneB(), 4, 8), (Interleaved(2), 2, 4),
                                         (Interleaved(3), 3, 6), (ZeroBubbleH1(), 3, 3)])
def test_default_layout_is_the_old_placement(sched: Schedule, p: int, m: int) -> None:
    # the same orders with the layout spelled out as c * p + w give the same timeline
    explicit = Table("explicit", sched.table(p, m),
                     [[c * p + w for c in range(sched.virtual_stages)] for w in range(p)],
                     sched.split_backward)
    for comm in (0.0, 0.5):
        assert simulate(explicit, p, m, comm=comm) == simulate(sched, p, m, comm=comm)


# ---------------------------------------------------------------------------------------
# torch.distributed.pipelining: the same orders, and no worse makespan / peak.

TORCH = {
    "zb-v": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
    "looped-bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
}


class Table(Schedule):
    """A fixed per-worker order on a given layout (torch's order, converted)."""

    def __init__(self, name: str, table: list[list[Action]], layout: list[list[int]],
                 split: bool) -> None:
        self.name, self.fixed, self.layout = name, table, layout
        self.split_backward, self.virtual_stages = split, len(layout[0])

    def stage_layout(self, num_workers: int) -> list[list[int]]:
        return self.layout

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        return self.fixed


def torch_schedule(name: str, p: int, m: int, v: int = 2) -> Table:
    """torch's per-rank compute order for `name` as a dagdiff Table, built on dummy stages
    (no process group: only the attributes torch's schedule constructors read)."""
    pytest.importorskip("torch")
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as e:   # a torch built without distributed
        pytest.skip(f"torch.distributed.pipelining is not available: {e}")
    cls_name, style = TORCH[name]
    takes_v = name in ("looped-bfs", "interleaved-zb")
    ours = get_schedule(name, **({"virtual_stages": v} if takes_v else {}))
    layout = ours.stage_layout(p)
    n = p * v
    stages = [types.SimpleNamespace(num_stages=n, group_size=p, group_rank=0, stage_index=g,
                                    submod=None, is_first=g == 0, is_last=g == n - 1)
              for g in (list(range(0, n, p)) if style == "loop" else [0, n - 1])]
    built = getattr(schedules, cls_name)(stages, m)
    # torch's stage -> rank mapping is our layout
    assert {g: w for w, gs in enumerate(layout) for g in gs} == {
        g: built.stage_index_to_group_rank[g] for g in range(n)}
    where = {g: c for gs in layout for c, g in enumerate(gs)}
    table = []
    for rank in range(p):
        acts: list[Action] = []
        for a in built.pipeline_order[rank]:
            if a is None:                      # a bubble slot: timing only
                continue
            for sub in a.sub_actions or (a,):  # OVERLAP_F_B: its F, then its B
                assert built.stage_index_to_group_rank[sub.stage_index] == rank
                kind, mb, chunk = sub.computation_type.value, sub.microbatch_index, where[
                    sub.stage_index]
                if kind == "B" and ours.split_backward:
                    # a full backward in a split schedule: its I then, at once, its W (this
                    # frees the upstream gradient earlier, so it only helps torch here)
                    acts += [Action("I", mb, chunk), Action("W", mb, chunk)]
                else:
                    acts.append(Action(kind, mb, chunk))
        table.append(acts)
    return Table("torch-" + name, table, layout, ours.split_backward)


def _torch_cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in NEW:
        for v in ((2, 3) if name in ("looped-bfs", "interleaved-zb") else (2,)):
            for p in (1, 2, 3, 4, 6):
                for m in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
                    cases.append((name, p, m, v))
    return cases


@pytest.mark.parametrize("name, p, m, v", _torch_cases())
def test_orders_equal_torchs(name: str, p: int, m: int, v: int) -> None:
    ours = get_schedule(name, **({"virtual_stages": v} if v != 2 else {}))
    try:
        theirs = torch_schedule(name, p, m, v)
    except (ValueError, RuntimeError):          # torch refuses this (p, m): so do we
        with pytest.raises(ScheduleError):
            ours.actions(p, m)
        return
    assert ours.table(p, m) == theirs.table(p, m)


@pytest.mark.parametrize("name, p, m, v", [
    ("zb-v", 1, 1, 2), ("zb-v", 2, 1, 2), ("zb-v", 2, 4, 2), ("zb-v", 3, 3, 2),
    ("zb-v", 4, 8, 2), ("zb-v", 4, 5, 2), ("zb-v", 8, 16, 2),
    ("dualpipev", 1, 2, 2), ("dualpipev", 2, 4, 2), ("dualpipev", 2, 5, 2),
    ("dualpipev", 4, 8, 2), ("dualpipev", 4, 11, 2), ("dualpipev", 8, 16, 2),
    ("looped-bfs", 1, 1, 2), ("looped-bfs", 2, 3, 2), ("looped-bfs", 4, 2, 2),
    ("looped-bfs", 4, 8, 2), ("looped-bfs", 4, 8, 3),
    ("interleaved-zb", 1, 1, 2), ("interleaved-zb", 2, 4, 2), ("interleaved-zb", 3, 2, 2),
    ("interleaved-zb", 4, 8, 2), ("interleaved-zb", 4, 10, 2), ("interleaved-zb", 4, 6, 2),
    ("interleaved-zb", 4, 8, 3),
])
def test_no_worse_than_torch(name: str, p: int, m: int, v: int) -> None:
    ours = get_schedule(name, **({"virtual_stages": v} if v != 2 else {}))
    theirs = torch_schedule(name, p, m, v)
    for comm in (0.0, 0.25):
        mine = simulate(ours, p, m, comm=comm, **SPLIT_COSTS)
        torch_res = simulate(theirs, p, m, comm=comm, **SPLIT_COSTS)
        assert mine.makespan <= torch_res.makespan + 1e-9
    assert max(ours.peak_live(p, m)) <= max(theirs.peak_live(p, m))


@pytest.mark.parametrize("schedule, p, m, expected", [t[1:] for t in TABLES],
                         ids=[t[0] for t in TABLES])
def test_literal_tables_are_torchs(schedule: Schedule, p: int, m: int,
                                   expected: list[list[str]]) -> None:
    theirs = torch_schedule(schedule.name, p, m, schedule.virtual_stages)
    assert theirs.actions(p, m) == expected
