"""A long training run keeps its memory flat: a worker forgets each step's tasks once the
next state exists, and neither the client nor the scheduler keeps old steps' graphs,
programs or batches (each was kept, in distributed's logs or a worker's task states,
for every step of a fit: ~75 KB a step on a worker with 64 KB batches)."""
from __future__ import annotations

import collections
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dagdiff as dd
from dagdiff.examples.simulated import sleepy_pipeline
from dagdiff.runtime import internals, live

pytestmark = [pytest.mark.distributed]


def _worker_tasks(dask_worker: Any) -> dict[str, int]:
    """How many tasks of each kind (key prefix, state) the worker still knows."""
    count = collections.Counter(f"{k.split('-')[0].split('_')[0]}:{t.state}"
                                for k, t in dask_worker.state.tasks.items()
                                if isinstance(k, str))
    return dict(count)


def _programs_known(dask_worker: Any) -> int:
    """Program tasks a worker knows, but those that failed: failed steps of other tests
    on this shared cluster stay known while their client holds them (pytest keeps their
    tracebacks' frames), and they are not this file's subject."""
    return sum(1 for k, ts in dask_worker.state.tasks.items()
               if isinstance(k, str) and k.startswith("prog") and ts.state != "error")


def _fit(client: Any, steps: int, window: Any, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    trainer = dd.Trainer(sleepy_pipeline(2, 0.0), optax.adam(1e-3), microbatches=4,
                         schedule="1f1b", client=client)
    batches = [(rng.standard_normal((16, 64), dtype=np.float32),) for _ in range(steps)]
    state, losses = trainer.fit(batches, params=[jnp.float32(1.0)] * 2, progress=False,
                                window=window)
    assert len(losses) == steps and np.all(np.isfinite(losses))
    return trainer, state


@pytest.mark.parametrize("window", [1, 8])
def test_a_worker_forgets_the_steps_behind_the_newest_state(client2: Any,
                                                            window: int) -> None:
    """Each step's pick reads the state the step before made (same worker): distributed's
    worker kept that chain of released tasks, with every step's programs and batch, for
    as long as the newest state lived. After 60 steps a worker now knows a handful of
    program tasks, not one per step (or window)."""
    _fit(client2, 4, window)                                    # compile, place
    _, state = _fit(client2, 60, window, seed=1)
    deadline = time.time() + 10
    while time.time() < deadline:
        known = client2.run(_programs_known)
        if max(known.values()) <= 6:
            break
        time.sleep(0.2)
    assert max(known.values()) <= 6, (known, client2.run(_worker_tasks))
    del state


def test_the_message_streams_keep_a_short_log(client2: Any) -> None:
    """distributed's streams keep their last 1000 payloads under 1 MB for debugging; a
    dagdiff payload holds a step's (or window's) graph, programs and batches, so every
    stream dagdiff tunes keeps the last ``dagdiff.message-log-length`` (16)."""
    _fit(client2, 3, 1)
    assert internals.client_stream(client2).recent_message_log.maxlen == 16

    def scheduler_side(dask_scheduler: Any) -> list[Any]:
        streams = list(internals.stream_comms(dask_scheduler).values())
        streams += [c for c in dask_scheduler.client_comms.values()]
        return [s.recent_message_log.maxlen for s in streams]

    assert set(client2.run_on_scheduler(scheduler_side)) == {16}
    assert set(client2.run(lambda dask_worker: internals.worker_stream(
        dask_worker).recent_message_log.maxlen).values()) == {16}


def test_the_scheduler_keeps_no_action_reports(client2: Any) -> None:
    """The workers' reports of their actions (the live dashboard) are used up as they
    come: the scheduler keeps none of them as events (it kept the last 1000, each 0.1 s
    of a worker's actions)."""
    with dd.record(client2):
        _fit(client2, 6, 1)

    def kept(dask_scheduler: Any) -> int:
        topic = dask_scheduler._broker._topics.get(live.TOPIC)
        return 0 if topic is None else len(topic.events)

    time.sleep(0.5)
    assert client2.run_on_scheduler(kept) == 0


def test_cut_released_lineage_leaves_tasks_in_use_alone() -> None:
    """A waiting task keeps its dependencies; a released task that something still waits
    for is not forgotten (the state machine's own rules, checked on stand-ins)."""

    class TS:
        def __init__(self, key: str, state: str) -> None:
            self.key, self.state = key, state
            self.dependencies: set[Any] = set()
            self.dependents: set[Any] = set()
            self.waiters: set[Any] = set()

    class State:
        def __init__(self, tasks: dict[str, Any]) -> None:
            self.tasks = tasks
            self.done: list[Any] = []

        def _transitions(self, recs: dict[Any, str], *, stimulus_id: str) -> list[Any]:
            self.done.append({t.key: v for t, v in recs.items()})
            return []

    class Worker:
        def __init__(self, state: State) -> None:
            self.state = state

    old, waiting, computed = TS("old", "released"), TS("next", "waiting"), TS("new", "memory")
    for t in (waiting, computed):
        t.dependencies.add(old)
        old.dependents.add(t)
        old.waiters.add(t)
    worker = Worker(State({"old": old, "next": waiting, "new": computed}))
    assert internals.cut_released_lineage(worker, "new") == 0     # `next` still reads it
    assert old.dependents == old.waiters == {waiting} and not computed.dependencies
    assert internals.cut_released_lineage(worker, "next") == 0    # not finished
    waiting.state = "memory"
    assert internals.cut_released_lineage(worker, "next") == 1
    assert worker.state.done == [{"old": "forgotten"}]
