"""Direct-dispatch actions in the dashboard's Task Stream while a step runs: every action of
every run once, on its worker, named by its key, inside its program's span; a switch."""
from __future__ import annotations

import collections
import time
from typing import Any

import dask
import pytest
from dask.utils import key_split
from distributed import get_task_stream
from distributed.diagnostics.task_stream import rectangles

import dagdiff as dd
from dagdiff.runtime.live import MARKER, ROW, ActionReporter, is_live_action
from tests.models import data, make_loss


#: seconds a bar may stick out of its program's span: both are shifted into the scheduler's
#: clock by the worker's offset estimate when reported, which each heartbeat re-estimates
#: (on this 2-core machine consecutive estimates differed by up to ~0.13 s under load)
SLACK = 0.25


def _action_log(dask_worker: Any = None) -> list[tuple[str, str, int]]:
    """(action key, program key, run number) of every action the worker's programs ran."""
    rt = dask_worker.extensions.get("dagdiff")
    return [] if rt is None else [(k, pk, n) for k, _, _, pk, n in rt.log]


def _ran(client: Any) -> collections.Counter[tuple[str, str]]:
    """(action key, worker) of every action run so far, counted (the runtime's own log)."""
    return collections.Counter((k, w) for w, rows in client.run(_action_log).items()
                               for k, _, _ in rows)


def _step(live: bool = True) -> tuple[Any, Any]:
    """A 2-stage 1F1B x4 step (direct dispatch on the cluster), built with the switch."""
    params, x, t = data(2, batch=16)
    with dask.config.set({"dagdiff.dashboard.live-actions": live}):
        return dd.value_and_grad(make_loss(2), microbatches=4, schedule="1f1b")(params, x, t)


def _streamed(client: Any, outs: Any, runs: int) -> list[dict[str, Any]]:
    """The task-stream records of computing `outs` `runs` times (the last report arrives
    before its program's result, on the same worker stream; poll briefly anyway)."""
    with get_task_stream(client) as ts:
        for _ in range(runs):
            client.compute(list(outs), sync=True)
        time.sleep(0.2)
    return ts.data


@pytest.mark.distributed
def test_every_action_is_a_bar_of_its_own_once_per_run(client2: Any) -> None:
    with client2.as_current():
        outs = _step()
        before = _ran(client2)
        data_ = _streamed(client2, outs, runs=2)
    ran = _ran(client2) - before
    live = [d for d in data_ if is_live_action(d)]
    got = collections.Counter((d["key"], d["worker"]) for d in live)
    assert got == ran and len(ran) >= 2 * 2 * 4             # F and B of 2 stages x 4
    assert set(got.values()) == {2}                         # the same step twice: 2 bars each
    phases = collections.Counter(dd.key_info(k).phase for k, _ in got)
    assert phases["F"] == phases["B"] == 2 * 4
    spans = collections.defaultdict(list)                   # program -> its (start, stop)s
    for d in data_:
        if not is_live_action(d) and key_split(d["key"]).startswith("prog_"):
            # a worker that still knew the key when it was computed again reports both
            # runs' compute spans in the second record
            computes = [(s["start"], s["stop"]) for s in d["startstops"]
                        if s["action"] == "compute"]
            assert 1 <= len(computes) <= 2, d["startstops"]
            spans[d["key"], d["worker"]].extend(computes)
    for d in live:
        (ss,) = d["startstops"]
        assert ss["action"] == "compute" and ss["start"] <= ss["stop"]
        assert any(a - SLACK <= ss["start"] and ss["stop"] <= b + SLACK
                   for a, b in spans[d["program"], d["worker"]]), (
            d["key"], ss, spans[d["program"], d["worker"]])
        assert d["status"] == "OK" and d["thread"] == ROW and d["dagdiff"] == MARKER
    # as the dashboard draws them: named by the key's prefix, one row per worker for the
    # actions, apart from the programs' rows
    rect = rectangles(data_)
    rows = collections.defaultdict(set)
    for name, row in zip(rect["name"], rect["worker_thread"]):
        rows[row].add(name)
    action_rows = {r for r in rows if r.endswith("-" + ROW)}
    assert len(action_rows) == 2
    assert all(not any(n.startswith("prog_") for n in rows[r]) for r in action_rows)
    names = set().union(*(rows[r] for r in action_rows))
    assert {"fwd_dense", "vjp_dense"} <= names
    assert {n.split("_")[0] for n in names} <= {"fwd", "vjp", "split", "loss", "acc", "add"}


@pytest.mark.distributed
def test_switched_off_nothing_is_reported_and_record_counts_once(client2: Any) -> None:
    with client2.as_current():
        off = _step(live=False)
        client2.compute(list(off), sync=True)
        assert not any(is_live_action(d) for d in _streamed(client2, off, runs=1))
        on = _step()
        with dd.record(client2) as rec:                    # reported bars are not counted
            client2.compute(list(on), sync=True)
    keys = collections.Counter(r.key for r in rec.tasks if r.phase in ("F", "B"))
    assert len(keys) == 2 * 2 * 4 and set(keys.values()) == {1}


@pytest.mark.distributed
def test_a_fit_windows_actions_are_bars_inside_its_task_reported_by_time(client2: Any
                                                                          ) -> None:
    """`fit(window=4)`: each action of each step a bar of its own, once, inside its
    window task's span on its worker; a window reports in batches by time (at most one
    report per `INTERVAL` of its span, plus its end), not one per step."""
    import optax

    from dagdiff.runtime.live import INTERVAL, TOPIC

    params, x, t = data(2, batch=16)
    tr = dd.Trainer(make_loss(2), optax.sgd(0.01), microbatches=4, schedule="1f1b",
                    client=client2)
    state, _ = tr.fit([(x, t)] * 4, params=params, progress=False, window=4)
    before = _ran(client2)
    seen = len(client2.get_events(TOPIC))
    with get_task_stream(client2) as ts:
        tr.fit([(x, t)] * 8, state=state, progress=False, window=4)
        time.sleep(0.2)
    ran = _ran(client2) - before
    live = [d for d in ts.data if is_live_action(d)]
    assert collections.Counter((d["key"], d["worker"]) for d in live) == ran
    assert sum(ran.values()) >= 8 * 2 * 4 * 2                 # F and B, 2 stages x 4, 8 steps
    spans = {(d["key"], d["worker"]): [(s["start"], s["stop"]) for s in d["startstops"]
                                       if s["action"] == "compute"]
             for d in ts.data if not is_live_action(d) and "_x4-" in d["key"]}
    assert len(spans) == 2 * 2                                 # 2 windows x 2 workers
    for d in live:
        (ss,) = d["startstops"]
        assert any(a - SLACK <= ss["start"] and ss["stop"] <= b + SLACK
                   for a, b in spans[d["program"], d["worker"]]), d
    reports = collections.Counter(m["program"] for _, m in client2.get_events(TOPIC)[seen:])
    for (key, _), ((a, b), *_) in spans.items():
        assert reports[key] <= 1 + (b - a) / INTERVAL + 1, (key, reports[key], b - a)


class _Worker:
    scheduler_delay = 1.0

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def log_event(self, topic: str, msg: Any) -> None:
        self.events.append((topic, msg))


def test_reports_are_batched_by_time_and_flushed_at_the_end() -> None:
    w = _Worker()
    r = ActionReporter(w, "prog_slot0-n0-ab", interval=0.1)
    t = r.last
    for i in range(5):                                      # 0, 40, ..., 160 ms
        r.add(f"fwd_dense-s0-m{i}-n1-ab", t + 0.04 * i, t + 0.04 * i + 0.03)
    assert [len(m["actions"]) for _, m in w.events] == [3]  # at 110 ms
    r.flush()
    r.flush()                                               # nothing left: no message
    assert [len(m["actions"]) for _, m in w.events] == [3, 2]
    topic, msg = w.events[0]
    assert topic == "dagdiff-actions" and msg["program"] == "prog_slot0-n0-ab"
    assert msg["actions"][0] == ["fwd_dense-s0-m0-n1-ab", t + 1.0, t + 1.03]
