"""Inspection: HTML table, graphviz source, timeline PNG, measured bubble vs formula,
and the notebooks (executed with small sizes)."""
from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import pytest

import dagdiff as dd
from dagdiff.inspect.record import PHASE_COLORS
from tests.models import data, make_loss


def test_html_repr_lists_layers_stages_shapes_params_tasks() -> None:
    params, x, t = data(4)
    g = dd.trace(make_loss(4), microbatches=4, schedule="1f1b", fuse=False)(params, x, t)
    html = g._repr_html_()
    for text in ("<table", "layer", "stage", "worker/device", "dense", "mse", "f32[4,8]",
                 "F:4", "B:4", "4 microbatches", "1f1b"):
        assert text in html, text
    rows = g.rows()
    assert [r["stage"] for r in rows] == [0, 1, 2, 3, 3]
    assert rows[0]["params"] == 8 * 8 + 8
    assert isinstance(g.loss, dask_delayed())


def dask_delayed() -> Any:
    from dask.delayed import Delayed

    return Delayed


def test_graphviz_source_counts_and_colours() -> None:
    params, x, t = data(2)
    g = dd.trace(make_loss(2), fuse=False)(params, x, t)
    src = g.to_graphviz().source
    phases = g.tasks_by_phase()
    assert phases["F"] == 3 and phases["B"] == 3
    assert src.count(f'fillcolor="{PHASE_COLORS["F"]}"') == phases["F"]
    assert src.count(f'fillcolor="{PHASE_COLORS["B"]}"') == phases["B"]
    assert "cluster_s0" in src and "cluster_s1" in src
    n_edges = sum(len(task.dependencies) for task in g.dsk.values())
    assert src.count("->") == n_edges


def test_the_graph_picture_needs_no_graphviz_binary(tmp_path: Any, monkeypatch: Any) -> None:
    """visualize('x.svg') with `dot` off PATH: dagdiff draws it; one box per task with its
    key as tooltip, coloured by phase, in one band per stage; shown inline in Jupyter."""
    import xml.etree.ElementTree as ET

    monkeypatch.setenv("PATH", str(tmp_path))          # no dot (nor anything else) here
    params, x, t = data(2)
    g = dd.trace(make_loss(2), microbatches=2, schedule="1f1b")(params, x, t)
    out = g.visualize(str(tmp_path / "graph.svg"))
    root = ET.parse(out).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    tasks = [e for e in root.iter(f"{ns}g") if e.get("class") == "task"]
    tips = sorted(e.find(f"{ns}title").text for e in tasks)
    assert tips == sorted(g.dsk)                          # every task once
    fills = {e.find(f"{ns}rect").get("fill") for e in tasks}
    assert {PHASE_COLORS["F"], PHASE_COLORS["B"]} <= fills
    bands = [e for e in root.iter(f"{ns}rect") if e.get("class") == "stage"]
    assert len(bands) == len({dd.key_info(k).stage for k in g.dsk})
    assert "<svg" in g._repr_html_()
    with pytest.raises(dd.MissingDependencyError, match="draws the picture without it"):
        g.visualize(str(tmp_path / "graph.png"))


def test_a_large_graph_is_summarised_not_refused(tmp_path: Any) -> None:
    import xml.etree.ElementTree as ET

    params, x, t = data(2, batch=64)
    g = dd.trace(make_loss(2), microbatches=16, schedule="1f1b")(params, x, t)
    out = g.visualize(str(tmp_path / "big.svg"), max_tasks=50)
    root = ET.parse(out).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    tips = [e.find(f"{ns}title").text for e in root.iter(f"{ns}g") if e.get("class") == "task"]
    assert len(g.dsk) > 50 and 0 < len(tips) < 50
    assert sum(int(tip.split()[0]) for tip in tips) == len(g.dsk)    # every task counted


def test_timeline_png_rows_and_blocks(tmp_path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import dask

    params, x, t = data(2)
    loss, grads = dd.value_and_grad(make_loss(2), microbatches=2, schedule="1f1b")(params, x, t)
    with dd.record() as rec:
        dask.compute(loss, grads, scheduler="sync")
    fig = rec.timeline(str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == len(rec.workers) == 1          # sync: one thread
    busy = [r for r in rec.tasks if r.phase in ("F", "B")]
    assert len(busy) == 2 * 2 * 2                                 # 2 stages x 2 mb x F/B
    labels = [tx.get_text() for tx in ax.texts]
    assert labels.count("0") >= 4 and labels.count("1") >= 4       # microbatch numbers


@pytest.mark.distributed
def test_a_recorded_step_saves_as_a_chrome_trace(client2: Any, tmp_path: Any) -> None:
    """Recording.save_trace: valid trace-event JSON (what Perfetto reads), one named track
    per worker, every recorded action once on its worker's track with its microbatch."""
    import json

    params, x, t = data(2, batch=16)
    with client2.as_current():
        loss, grads = dd.value_and_grad(make_loss(2), microbatches=4, schedule="1f1b")(
            params, x, t)
        with dd.record(client2) as rec:
            client2.compute([loss, grads], sync=True)
    rec.save_trace(str(tmp_path / "step.json"))
    trace = json.loads((tmp_path / "step.json").read_text())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(tracks) == len(rec.workers) == 2
    slices = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in slices)
    want = sorted((r.key, r.worker, r.microbatch) for r in rec.tasks if r.phase in ("F", "B"))
    got = sorted((e["args"]["key"], e["args"]["worker"], e["args"]["microbatch"])
                 for e in slices if e["cat"] in ("F", "B"))
    assert got == want and len(got) == 2 * 2 * 4           # 2 stages x F/B x 4 microbatches
    by_track = {tid: {e["args"]["worker"] for e in slices if e["tid"] == tid} for tid in tracks}
    assert all(len(ws) == 1 for ws in by_track.values())   # one worker per track


def test_the_interactive_timeline_has_every_task_once(tmp_path: Any) -> None:
    """Recording.chart (bokeh): one bar per recorded task on its worker's row, with the
    hover fields; save_html writes a standalone page holding the same data."""
    import dask
    from bokeh.models import ColumnDataSource, HoverTool

    params, x, t = data(2)
    loss, grads = dd.value_and_grad(make_loss(2), microbatches=2, schedule="1f1b")(params, x, t)
    with dd.record() as rec:
        dask.compute(loss, grads, scheduler="threads")
    fig = rec.chart()
    (src,) = [m for m in fig.references() if isinstance(m, ColumnDataSource)]
    assert sorted(src.data["key"]) == sorted(r.key for r in rec.tasks)
    assert set(src.data["worker"]) == {rec.worker_names.get(w, w) for w in rec.workers}
    busy = [i for i, p in enumerate(src.data["phase"]) if p in ("F", "B")]
    assert {src.data["microbatch"][i] for i in busy} == {"0", "1"}
    (hover,) = [m for m in fig.tools if isinstance(m, HoverTool)]
    fields = {name for name, _ in hover.tooltips}
    assert {"task", "layer", "stage", "microbatch", "duration"} <= fields
    assert "bubble" in fig.title.text
    page = (tmp_path / "t.html")
    rec.save_html(str(page))
    text = page.read_text()
    assert all(r.key in text for r in rec.tasks)


@pytest.mark.distributed
@pytest.mark.slow
def test_measured_bubble_matches_formula(client4: Any) -> None:
    from dagdiff.schedules import bubble_formula
    from dagdiff.examples.simulated import sleepy_pipeline

    p, m, f = 4, 4, 0.15
    fn = sleepy_pipeline(p, f)
    params = [jnp.float32(1.0)] * p
    with client4.as_current():
        for i in range(2):                        # the first run compiles
            loss, grads = dd.value_and_grad(fn, microbatches=m, schedule="1f1b")(
                params, jnp.ones((m, 2)) * (i + 1))
            with dd.record() as rec:
                client4.compute([loss, grads], sync=True)
    measured = rec.bubble_fraction()
    formula = bubble_formula("1f1b", p, m)
    assert len(measured.per_worker) == p
    assert abs(measured.overall - formula) <= 0.1 * formula, (measured, formula)


NOTEBOOKS = sorted(os.listdir(os.path.join(os.path.dirname(__file__), "..", "notebooks")))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NOTEBOOKS if n.endswith(".ipynb")])
def test_notebook_runs(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    import nbformat
    from nbclient import NotebookClient

    path = os.path.join(os.path.dirname(__file__), "..", "notebooks", name)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                          # committed without outputs
        assert not cell.get("outputs"), f"{name}: commit notebooks with outputs stripped"
    monkeypatch.setenv("DAGDIFF_SMALL", "1")
    # a cell that hangs fails here (naming the cell) before pytest-timeout's 300 s
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()


@pytest.mark.distributed
def test_record_of_a_cluster_uses_its_current_client_or_says_to_make_one(client2: Any) -> None:
    """dd.record(cluster) (what `dd.local_cluster()` returns) records through the cluster's
    current client; with none current it names the fix instead of a TypeError."""
    params, x, t = data(2, batch=8)
    with client2.as_current():
        loss, grads = dd.value_and_grad(make_loss(2), microbatches=2, schedule="1f1b")(
            params, x, t)
        with dd.record(client2.cluster) as rec:
            client2.compute([loss, grads], sync=True)
    assert len([r for r in rec.tasks if r.phase in ("F", "B")]) == 2 * 2 * 2

    class Elsewhere:
        scheduler_address = "tcp://10.0.0.1:8786"
        scheduler_info = None

    with pytest.raises(dd.ArgumentError, match=r"Client\(cluster\)"):
        with dd.record(Elsewhere()):
            pass


# the classic 1F1B order of 4 workers x 8 microbatches (Narayanan et al.; torch's
# Schedule1F1B gives the same rows)
ONE_F_ONE_B_4x8 = [
    "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
]


@pytest.mark.distributed
@pytest.mark.parametrize("dispatch", ["direct", "scheduler"])
def test_recording_a_step_computed_a_second_time_lists_each_action_once(
        client4: Any, dispatch: str) -> None:
    """The same step computed again (the first run's results still held) inside
    dd.record: every action once, each worker's row in 1F1B's order (a worker that still
    knows a key reports every run's start/stop in the record of the last one)."""
    params, x, t = data(4, batch=32)
    step = dd.value_and_grad(make_loss(4), microbatches=8, schedule="1f1b", dispatch=dispatch)
    with client4.as_current():
        first = client4.compute(list(step(params, x, t)))
        client4.gather(first)
        with dd.record(client4) as rec:
            client4.gather(client4.compute(list(step(params, x, t))))
    fb = [r for r in rec.compute_tasks() if r.phase in ("F", "B")]
    assert len(fb) == 4 * 8 * 2 and len({(r.key, r.worker) for r in fb}) == len(fb)
    if dispatch == "direct":                   # each worker runs its program in this order
        rows = [" ".join(f"{r.phase}{r.microbatch}"
                         for r in sorted(fb, key=lambda r: r.start) if r.worker == w)
                for w in rec.workers]
        assert rows == ONE_F_ONE_B_4x8
    assert rec.bubble_fraction().overall < 1.0


@pytest.mark.distributed
def test_recording_steps_whose_values_came_by_push_shows_every_program(
        client4: Any) -> None:
    """Regression: `step.compute` takes its values as the programs push them, a moment
    before the programs' tasks end; a recording that closed then (or a step that released
    its futures then, which makes the scheduler cancel a task still running) lost a
    worker's actions about one time in four. Each of several recorded steps shows all of
    its actions."""
    from dagdiff.runtime.direct.inbox import inbox_for

    params, x, t = data(4, batch=32)
    step = dd.value_and_grad(make_loss(4), microbatches=8, schedule="1f1b")
    for _ in range(2):                    # the inbox connects to each worker on first use
        step.compute(params, x, t, client=client4)
    box = inbox_for(client4)
    assert box is not None
    before = box.stats()["pushed"]
    for i in range(4):
        with dd.record(client4) as rec:
            step.compute(params, x, t, client=client4)
        fb = [r for r in rec.compute_tasks() if r.phase in ("F", "B")]
        assert len(fb) == 4 * 8 * 2, (i, sorted({r.worker for r in fb}))
    assert box.stats()["pushed"] > before     # the values did come by push


@pytest.mark.distributed
def test_a_trace_on_a_cluster_shows_the_forward_and_vjp_tasks(client2: Any) -> None:
    """dd.trace with a cluster client current showed direct dispatch's program tasks
    only (11 tasks, no F or B); it shows the forward and VJP tasks as without a cluster
    (direct dispatch runs those same tasks as actions), unless dispatch= says otherwise."""
    params, x, t = data(2, batch=16)
    with client2.as_current():
        g = dd.trace(make_loss(2), microbatches=4, schedule="1f1b")(params, x, t)
        programs = dd.trace(make_loss(2), microbatches=4, schedule="1f1b",
                            dispatch="direct")(params, x, t)
    local = dd.trace(make_loss(2), microbatches=4, schedule="1f1b")(params, x, t)
    phases = g.tasks_by_phase()
    assert phases["F"] == local.tasks_by_phase()["F"] == 2 * 4
    assert phases["B"] == 2 * 4
    assert programs.tasks_by_phase()["F"] == 0


@pytest.mark.distributed
def test_a_recording_holds_no_action_of_a_step_that_ended_before_it(client2: Any) -> None:
    """`step.compute` returns once the programs push their values, a moment before the
    scheduler hears that the program tasks ended; a recording opened right after it
    held that earlier step's actions too (3 recordings in 30 had 24 or 32 F/B actions
    instead of 16, and a bubble of 0.99). Each recording now holds its own step only."""
    params, x, t = data(2, batch=16)
    step = dd.value_and_grad(make_loss(2), microbatches=4, schedule="1f1b")
    step.compute(params, x, t, client=client2)
    for i in range(12):
        step.compute(params, x - 1.0 - i, t, client=client2)
        with dd.record(client2) as rec:
            step.compute(params, x + i, t, client=client2)
        fb = [r for r in rec.compute_tasks() if r.phase in ("F", "B")]
        assert len(fb) == 2 * 4 * 2, (i, len(fb))


@pytest.mark.distributed
def test_recording_a_trainer_step_shows_every_program(client4: Any, tmp_path: Any) -> None:
    """A `Trainer.step` whose loss came by push, read inside the block, a moment before
    its programs' tasks end (the README's `dd.record` example, and `python -m dagdiff demo
    --timeline`, which a fresh-clone CI run saw fail: the recording held no task and the
    timeline's legend had no column): each of several recorded steps shows all of its
    actions, and a recording of nothing draws an empty timeline."""
    import optax

    params, x, t = data(4, batch=32)
    tr = dd.Trainer(make_loss(4), optax.sgd(0.01), microbatches=8, schedule="1f1b",
                    client=client4)
    state = tr.init(params)
    for _ in range(2):
        state, loss = tr.step(state, x, t)
        loss.result()
    for i in range(4):
        with dd.record(client4) as rec:
            state, loss = tr.step(state, x, t)
            loss.result()
        fb = [r for r in rec.compute_tasks() if r.phase in ("F", "B")]
        assert len(fb) == 4 * 8 * 2, (i, sorted({r.worker for r in fb}))
    rec.timeline(str(tmp_path / "step.png"))
    with dd.record(client4) as empty:
        pass
    assert not empty.tasks
    empty.timeline(str(tmp_path / "empty.png"))
    assert (tmp_path / "empty.png").stat().st_size > 0


@pytest.mark.distributed
@pytest.mark.parametrize("window", [1, 4])
def test_recording_a_fit_shows_every_steps_actions_in_windows_too(
        client4: Any, window: int) -> None:
    """dd.record around `Trainer.fit`: each of its steps' forward and backward actions
    once, on its stage's worker, in 1F1B's order step after step, whether each step is
    its own Dask computation (window=1) or 4 steps run as one task per worker (a window:
    fit's default picks one for short steps)."""
    import optax

    params, x, t = data(4, batch=32)
    batches = [(x, t)] * 8
    tr = dd.Trainer(make_loss(4), optax.sgd(0.01), microbatches=8, schedule="1f1b",
                    client=client4)
    state, _ = tr.fit(batches[:window], params=params, progress=False, window=window)
    with dd.record(client4) as rec:
        state, losses = tr.fit(batches, state=state, progress=False, window=window)
    assert len(losses) == 8
    fb = [r for r in rec.compute_tasks() if r.phase in ("F", "B")]
    assert len(fb) == 8 * 4 * 8 * 2
    rows = {w: " ".join(f"{r.phase}{r.microbatch}"
                        for r in sorted(fb, key=lambda r: r.start) if r.worker == w)
            for w in rec.workers}
    by_stage = {r.stage: r.worker for r in fb}
    assert len(set(by_stage.values())) == 4
    for stage, row in enumerate(ONE_F_ONE_B_4x8):
        assert rows[by_stage[stage]] == " ".join([row] * 8), stage


def test_a_recording_shows_itself_in_jupyter(monkeypatch: Any) -> None:
    """`rec` in a cell: the interactive chart as HTML (BokehJS inline, every task's key in
    the page), the timeline PNG when bokeh is missing, a one-line text otherwise."""
    import dask

    import dagdiff.inspect.record as record_mod

    params, x, t = data(2)
    loss, grads = dd.value_and_grad(make_loss(2), microbatches=2, schedule="1f1b")(params, x, t)
    with dd.record() as rec:
        dask.compute(loss, grads, scheduler="threads")
    bundle = rec._repr_mimebundle_()
    assert "makespan" in bundle["text/plain"] and "image/png" not in bundle
    assert "Bokeh" in bundle["text/html"] and all(r.key in bundle["text/html"] for r in rec.tasks)
    monkeypatch.setattr(record_mod, "available", lambda m: m != "bokeh")
    png = rec._repr_mimebundle_()
    assert "text/html" not in png and png["image/png"].startswith(b"\x89PNG")
    monkeypatch.setattr(record_mod, "available", lambda m: False)
    assert set(rec._repr_mimebundle_()) == {"text/plain"}
    assert set(record_mod.Recording()._repr_mimebundle_()) == {"text/plain"}   # empty


def test_bubble_fraction_takes_the_names_rec_workers_gives() -> None:
    """`rec.workers` lists addresses; `bubble_fraction().per_worker` is keyed by slot
    names (as the pictures are): a loop over the one indexing the other worked for
    neither (KeyError); both names now give the same share, by hand: worker a busy 1 of
    the 4 s window, worker b 4 of 4."""
    from dagdiff.inspect.record import Recording, TaskRecord

    rec = Recording()
    rec.tasks = [TaskRecord("fwd-a", "tcp://a:1", 0.0, 1.0, "F", "l", 0, 0),
                 TaskRecord("fwd-b", "tcp://b:2", 0.0, 4.0, "F", "l", 1, 0)]
    rec.worker_names = {"tcp://a:1": "slot0", "tcp://b:2": "slot1"}
    per = rec.bubble_fraction().per_worker
    assert sorted(per) == ["slot0", "slot1"]
    assert [per[w] for w in rec.workers] == [0.75, 0.0]
    assert per["slot0"] == 0.75 and "tcp://a:1" in per and "tcp://c:3" not in per
    with pytest.raises(KeyError):
        per["tcp://c:3"]
    assert [per.get(w) for w in rec.workers] == [0.75, 0.0]     # .get as [] (was None)
    assert per.get("tcp://c:3") is None and per.get("tcp://c:3", 1.0) == 1.0
    import pickle
    again = pickle.loads(pickle.dumps(per))
    assert again == per and again["tcp://b:2"] == 0.0


def _nap(x: Any) -> None:
    import time

    time.sleep(0.5)


@dd.layer(name="napping_dense")
def _napping_dense(p: Any, x: Any) -> Any:
    import jax

    jax.debug.callback(_nap, x[0, 0])
    return jnp.tanh(x @ p["w"] + p["b"])


def _napping_loss(params: Any, x: Any, t: Any) -> Any:
    from tests.models import mse

    h = x
    for i, p in enumerate(params):
        with dd.stage(i):
            h = _napping_dense(p, h)
    return mse(h, t)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_recording_does_not_wait_for_another_clients_programs(client2: Any) -> None:
    """Regression (a helper session: each `dd.record` block took 2 s longer at its start and
    its end while a second notebook's client trained): a recording waits for the programs
    of its own client's steps to end, not for another client's."""
    import time

    from distributed import Client

    from dagdiff.inspect.capture import _programs_running

    other = Client(client2.scheduler.address, set_as_default=False)
    try:
        params, x, t = data(2, batch=8)
        with other.as_current():
            loss, grads = dd.value_and_grad(_napping_loss, microbatches=2, schedule="1f1b")(
                params, x, t)
            futures = other.compute([loss, *grads])
        deadline = time.monotonic() + 30
        while not other.run_on_scheduler(_programs_running, other.id):
            assert time.monotonic() < deadline, "the other client's programs never ran"
            time.sleep(0.05)
        assert client2.run_on_scheduler(_programs_running, client2.id) == 0
        assert client2.run_on_scheduler(_programs_running) >= 1      # any client's
        other.gather(futures)
    finally:
        other.close()
