"""Microbatched pipelines: full-batch parity, executed per-worker order, live-pullback bound."""
from __future__ import annotations

from typing import Any

import dask
import jax
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.schedules import Action
from tests import models as M
from tests.models import close, data, make_loss


@pytest.mark.parametrize("schedule,n_stages,m", [
    ("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 3, 2), ("zb-h1", 4, 8), ("interleaved", 8, 4),
    ("1f1b", 2, 5), ("zb-v", 4, 3), ("zb-v", 6, 6), ("dualpipev", 4, 4), ("dualpipev", 6, 7),
    ("looped-bfs", 6, 2), ("interleaved-zb", 4, 4), ("interleaved-zb", 6, 3),
])
def test_pipeline_equals_full_batch(schedule: str, n_stages: int, m: int) -> None:
    loss_fn = make_loss(n_stages)
    params, x, t = data(n_stages, batch=2 * m)
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    loss, grads = dd.value_and_grad(loss_fn, microbatches=m, schedule=schedule)(params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


def test_zero_bubble_splits_backward_into_input_and_weight_grads() -> None:
    loss_fn = make_loss(4)
    params, x, t = data(4)
    loss, _ = dd.value_and_grad(loss_fn, microbatches=4, schedule="zb-h1",
                                fuse=False)(params, x, t)
    phases = [dd.key_info(k).phase for k in loss.__dask_graph__()]
    assert "B" not in phases
    # dense layers on stages 1..3 need both; stage 0's input is data (no I); mse has no W
    assert phases.count("W") == 4 * 4 and phases.count("I") == 4 * (3 + 1)
    loss, _ = dd.value_and_grad(loss_fn, microbatches=4, schedule="zb-h1")(params, x, t)
    phases = [dd.key_info(k).phase for k in loss.__dask_graph__()]
    # fused (the pipeline default): one I and one W task per stage and microbatch, but
    # none for stage 0's input (data)
    assert phases.count("W") == 4 * 4 and phases.count("I") == 4 * 3


def test_bad_microbatch_split_names_the_argument() -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=10)
    with pytest.raises(dd.MicrobatchError, match=r"'x'.*\(10, 8\).*4 microbatches"):
        dd.value_and_grad(loss_fn, microbatches=4)(params, x, t)


def test_a_prng_key_argument_is_named_not_split() -> None:
    """A PRNG key passed after the batch (dropout) was split into microbatches like the
    batch, and the layer then failed on a uint32[1] "key"; the error now names the key
    and the batch_argnums that keep it whole, with which the step runs."""
    from tests.models import dense, mse

    @dd.layer
    def dropout(x: Any, key: Any) -> Any:
        return jax.numpy.where(jax.random.bernoulli(key, 0.9, x.shape), x / 0.9, 0.0)

    def loss_fn(params: Any, x: Any, t: Any, key: Any) -> Any:
        with dd.stage(0):
            h = dropout(dense(params[0], x), key)
        with dd.stage(1):
            return mse(dense(params[1], h), t)

    params, x, t = data(2, batch=8)
    for key in (jax.random.PRNGKey(3), jax.random.key(3)):
        with pytest.raises(dd.MicrobatchError,
                           match=r"'key' is a PRNG key.*batch_argnums=\(1, 2\)"):
            dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")(params, x, t, key)
    loss, _ = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b",
                                batch_argnums=(1, 2))(params, x, t, jax.random.PRNGKey(3))
    assert np.isfinite(dask.compute(loss, scheduler="sync")[0])

def test_pipeline_needs_stages() -> None:
    params, x, t = data(2)
    with pytest.raises(dd.PlacementError, match="dense"):
        dd.value_and_grad(M.mlp_loss, microbatches=2, schedule="1f1b")(params[:2], x, t)
    loss, grads = dd.value_and_grad(M.mlp_loss, microbatches=2, schedule="1f1b",
                                    stages=2)(params[:2], x, t)
    close(dask.compute(grads, scheduler="sync")[0], jax.grad(M.mlp_loss)(params[:2], x, t))


def test_a_layer_or_operator_after_the_last_stage_block_runs_on_its_inputs_stage() -> None:
    """``return mse(h, t)`` after the last ``with dd.stage(k):`` block (the README's
    model), and ``loss * 2`` or ``loss / n`` on it (operators on traced values), run on
    their inputs' stage; values equal jax's. One reading two stages outside any block
    still needs a stage, and the error says so."""
    from tests.models import dense, mse

    def scaled(params: Any, x: Any, t: Any) -> Any:
        h = x
        for i, p in enumerate(params):
            with dd.stage(i * 2 // len(params)):
                h = dense(p, h)
        loss = mse(h, t)
        return -(loss * 2.0) / 3.0 + loss

    params, x, t = data(2, batch=8)
    step = dd.value_and_grad(scaled, microbatches=4, schedule="1f1b")
    loss, grads = step(params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    want_l, want_g = jax.value_and_grad(scaled)(params, x, t)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)
    rows = dd.trace(scaled, microbatches=4, schedule="1f1b", fuse=False)(params, x, t).rows()
    ops = [r for r in rows if r["layer"] in ("mse", "mul", "truediv", "neg", "add")]
    assert len(ops) == 5 and {r["stage"] for r in ops} == {1}, ops

    def mixed(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h0 = dense(params[0], x)
        with dd.stage(1):
            h1 = dense(params[1], h0)
        h = h0 + h1                 # outside any block, reading stages 0 and 1
        with dd.stage(1):
            return mse(h, t)

    with pytest.raises(dd.PlacementError, match="add.*inputs' stage"):
        dd.value_and_grad(mixed, microbatches=4, schedule="1f1b")(params, x, t)


def _aux_of(which: str, step: int) -> Any:
    """A loss function whose aux holds a string, the step (a Python int argument) and the
    traced value `which` names; "extra" adds a key."""
    def fn(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h0 = M.dense(params[0], x)
        with dd.stage(1):
            h1 = M.dense(params[1], h0)
            aux = {"tag": "run1", "step": step, "h": h1 if which == "h1" else h0}
            if which == "extra":
                aux["more"] = "yes"
            return M.mse(h1, t), aux
    return fn


@pytest.mark.parametrize("where", ["threads", "distributed"])
def test_aux_literals_and_values_are_each_steps_own(where: str, request: Any) -> None:
    """Regression: a pipelined step's aux holding a string took it for a Dask key (a bare
    KeyError, a cancelled step on a cluster), and a step reusing an earlier one's lowering
    gave that step's numbers and strings, or its traced aux value, instead of its own
    (one `dd.value_and_grad` over steps that return other aux values; functions of one
    structure). Each step's aux equals jax's."""
    params, x, t = data(2)
    client = request.getfixturevalue("client2") if where == "distributed" else None
    for i, which in enumerate(["h0", "h1", "h0", "extra"]):
        fn = _aux_of(which, i)
        step = dd.value_and_grad(fn, has_aux=True, microbatches=4, schedule="1f1b")
        if client is None:
            (loss, aux), grads = dask.compute(*step(params, x, t), scheduler="threads")
        else:
            with client.as_current():
                (loss, aux), grads = dask.compute(*step(params, x, t))
        (wl, waux), wg = jax.value_and_grad(fn, has_aux=True)(params, x, t)
        np.testing.assert_allclose(loss, wl, rtol=1e-5)
        close(grads, wg)
        assert len(aux) == 4
        for a in aux:
            assert {k: v for k, v in a.items() if k != "h"} == \
                {k: v for k, v in waux.items() if k != "h"}
        np.testing.assert_allclose(np.concatenate([a["h"] for a in aux]), waux["h"],
                                   rtol=1e-5, atol=1e-6)


def test_batch_axis_and_aux() -> None:
    params, x, t = data(2)

    def fn2(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = M.dense(params[0], x)
        with dd.stage(1):
            y = M.linear(params[1], h)
            return M.mse(y, t), {"y": y}

    (loss, aux), grads = dd.value_and_grad(fn2, has_aux=True, microbatches=4,
                                           schedule="1f1b")(params, x, t)
    got_l, got_aux, got_g = dask.compute(loss, aux, grads, scheduler="sync")
    (wl, waux), wg = jax.value_and_grad(fn2, has_aux=True)(params, x, t)
    assert len(got_aux) == 4
    np.testing.assert_allclose(np.concatenate([a["y"] for a in got_aux]), waux["y"],
                               rtol=1e-5, atol=1e-6)
    close(got_g, wg)

    @dd.layer(stage=0)
    def colwise(p: Any, xt: Any) -> Any:
        return (p["w"].T @ xt)                     # (out, batch): batch on axis 1

    def fn3(p: Any, xt: Any, tt: Any) -> Any:
        with dd.stage(1):
            return M.mse(colwise(p, xt), tt)

    p = {"w": params[0]["w"]}
    loss, grads = dd.value_and_grad(fn3, microbatches=4, schedule="gpipe",
                                    batch_axis=1)(p, x.T, t.T)
    close(dask.compute(grads, scheduler="sync")[0], jax.grad(fn3)(p, x.T, t.T))


class Backwards(dd.Schedule):
    """A user schedule: GPipe with backwards in reverse microbatch order."""

    name = "gpipe-reversed"

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        f = [Action("F", i) for i in range(microbatches)]
        b = [Action("B", i) for i in reversed(range(microbatches))]
        return [f + b for _ in range(num_stages)]


def test_user_schedule_subclass() -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2)
    assert Backwards().actions(2, 3)[0] == ["F0", "F1", "F2", "B2", "B1", "B0"]
    loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule=Backwards())(params, x, t)
    close(dask.compute(grads, scheduler="threads")[0], jax.grad(loss_fn)(params, x, t))


class _Orders(dd.Schedule):
    """A user schedule given as literal per-worker lists (the same list on every worker)."""

    name = "literal"

    def __init__(self, order: list[str], split: bool = False) -> None:
        self.order, self.split_backward = order, split

    def orders(self, num_stages: int, microbatches: int) -> Any:
        return (list(self.order) for _ in range(num_stages))   # a generator of strings


@pytest.mark.parametrize("order,split,message", [
    (["F0", "F1", "F0", "B0", "B1"], False, "worker 0 has extra F0"),
    (["F0", "F1", "B0"], False, "worker 0 is missing B1"),
    (["F0", "F1", "F2", "B0", "B1", "B2"], False, "has extra F2, B2"),
    (["F0", "F1", "I0", "W0", "I1", "W1"], False, "I and W need split_backward"),
    (["F0", "F1", "B0", "B1"], True, "is missing I0, W0, I1, W1"),
    (["B0", "B1", "F0", "F1"], False, "deadlock"),
])
def test_a_user_schedule_that_is_incomplete_or_cannot_run_fails_when_building(
        order: list[str], split: bool, message: str) -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=4)
    with pytest.raises(dd.ScheduleError, match=message):
        dd.value_and_grad(loss_fn, microbatches=2, schedule=_Orders(order, split))(
            params, x, t)


def test_a_user_schedule_may_be_strings_from_a_generator() -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=4)
    sched = _Orders(["F0", "F1", "B1", "B0"])
    loss, grads = dd.value_and_grad(loss_fn, microbatches=2, schedule=sched)(params, x, t)
    close(dask.compute(grads, scheduler="sync")[0], jax.grad(loss_fn)(params, x, t))


def _back_and_forth(params: Any, x: Any, t: Any) -> Any:
    h = x
    for i, p in enumerate(params):
        with dd.stage(i % 2):              # stages 0, 1, 0, 1: back to an earlier stage
            h = M.dense(p, h)
    with dd.stage(1):
        return M.mse(h, t)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_model_that_goes_back_to_an_earlier_stage_is_named_when_building(
        schedule: str) -> None:
    params, x, t = data(4, batch=8)
    with pytest.raises(dd.ScheduleError, match="goes back to an earlier stage") as e:
        dd.value_and_grad(_back_and_forth, microbatches=4, schedule=schedule)(params, x, t)
    assert "'dense' on stage 0 reads 'dense' on stage 1" in str(e.value)
    assert "interleaved" in str(e.value) and "gpipe" in str(e.value)


def test_gpipe_runs_a_model_that_goes_back_to_an_earlier_stage() -> None:
    params, x, t = data(4, batch=8)
    loss, grads = dd.value_and_grad(_back_and_forth, microbatches=4, schedule="gpipe")(
        params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    want_l, want_g = jax.value_and_grad(_back_and_forth)(params, x, t)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


def executed_orders(client: Any, loss_fn: Any, args: Any, m: int, schedule: str,
                    p: int, dispatch: str | None = None) -> tuple[list[list[str]], Any]:
    """Per worker, the F/B/I/W actions in the order they computed (dd.record: the task
    stream, with direct-dispatch programs' actions read from their workers)."""
    with client.as_current():
        loss, grads = dd.value_and_grad(loss_fn, microbatches=m, schedule=schedule,
                                        dispatch=dispatch)(*args)
        dd.reset_peak_live(client)
        dd.reset_remat_count(client)
        with dd.record(client) as rec:
            got = client.compute([loss, grads], sync=True)
    per_worker: dict[int, list[tuple[float, str]]] = {i: [] for i in range(p)}
    for t in rec.tasks:
        if t.phase not in ("F", "B", "I", "W"):
            continue
        w = int(rec.worker_names[t.worker][4:])
        assert w == t.stage % p
        per_worker[w].append((t.start, f"{t.phase}{t.microbatch}"))
    orders = []
    for w in range(p):
        seq = [a for _, a in sorted(per_worker[w])]
        orders.append([a for i, a in enumerate(seq) if i == 0 or seq[i - 1] != a])
    return orders, got


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,dispatch", [("1f1b", "direct"), ("gpipe", "direct"),
                                               ("zb-h1", "direct"), ("1f1b", "scheduler"),
                                               ("zb-h1", "scheduler")])
def test_executed_order_per_worker_matches_schedule(client4: Any, schedule: str,
                                                    dispatch: str) -> None:
    p, m = 4, 8
    loss_fn = make_loss(p)
    params, x, t = data(p, batch=16)
    orders, got = executed_orders(client4, loss_fn, (params, x, t), m, schedule, p,
                                  dispatch)
    want_actions = dd.get_schedule(schedule).actions(p, m)
    for w in range(p):
        # stage 0's single layer gets no I task (its input is data): drop those actions
        expected = [a for a in want_actions[w] if not (w == 0 and a[0] == "I")]
        assert orders[w] == expected, f"worker {w}: {orders[w]} != {expected}"
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1], want_g)
    assert dd.remat_count(client4) == 0       # no forward result had to move
    peak = dd.peak_live(client4)
    if schedule == "1f1b":
        assert peak == {s: p - s for s in range(p)}
    elif schedule == "gpipe":
        assert peak == {s: m for s in range(p)}
    else:   # ZB-H1: no more than 1F1B's worst stage (forward state lives until W)
        assert max(peak.values()) <= p


def _per_stage_peaks(schedule: Any, p: int, m: int) -> dict[int, int]:
    """From the schedule's table: per global stage, the most microbatches whose forward
    state is alive at once (F allocates, B or W frees), the bound dd.peak_live measures."""
    layout = schedule.stage_layout(p)
    peaks: dict[int, int] = {}
    for w, acts in enumerate(schedule.table(p, m)):
        live: dict[int, int] = {}
        for a in acts:
            stage = layout[w][a.chunk]
            if a.kind == "F":
                live[stage] = live.get(stage, 0) + 1
                peaks[stage] = max(peaks.get(stage, 0), live[stage])
            elif a.kind in ("B", "W"):
                live[stage] -= 1
    return peaks


@pytest.mark.distributed
@pytest.mark.parametrize("name,m", [("zb-v", 4), ("dualpipev", 4), ("looped-bfs", 3),
                                    ("interleaved-zb", 4), ("interleaved", 4)])
def test_multi_chunk_schedules_run_their_layout_and_order(client2: Any, name: str,
                                                          m: int) -> None:
    """Two chunks per worker on 2 workers (4 stages): each stage runs on the worker the
    schedule's layout gives it (V layouts: worker w holds stages w and 3 - w), each worker
    computes its actions in the schedule's order, the live-forward bound per stage is the
    schedule's, and loss and grads equal jax.value_and_grad."""
    sched = dd.get_schedule(name)
    p, n_stages = 2, 4
    loss_fn = make_loss(n_stages)
    params, x, t = data(n_stages, batch=2 * m)
    client = client2
    with client.as_current():
        loss, grads = dd.value_and_grad(loss_fn, microbatches=m, schedule=name)(params, x, t)
        dd.reset_peak_live(client)
        dd.reset_remat_count(client)
        with dd.record(client) as rec:
            got = client.compute([loss, grads], sync=True)
    layout = sched.stage_layout(p)
    worker_of_stage = {s: w for w, chunks in enumerate(layout) for s in chunks}
    chunk_of_stage = {s: c for chunks in layout for c, s in enumerate(chunks)}
    per_worker: dict[int, list[tuple[float, str]]] = {w: [] for w in range(p)}
    for task in rec.tasks:
        if task.phase not in ("F", "B", "I", "W"):
            continue
        w = int(rec.worker_names[task.worker][4:])
        assert w == worker_of_stage[task.stage], (task.key, rec.worker_names[task.worker])
        per_worker[w].append((task.start, f"{task.phase}{task.microbatch}."
                                          f"{chunk_of_stage[task.stage]}"))
    for w in range(p):
        seq = [a for _, a in sorted(per_worker[w])]
        done = [a for i, a in enumerate(seq) if i == 0 or seq[i - 1] != a]
        # stage 0 (one layer reading data) has no input-gradient (I) task
        want = [a.format(True) for a in sched.table(p, m)[w]
                if not (a.kind == "I" and layout[w][a.chunk] == 0)]
        assert done == want, f"worker {w}: {done} != {want}"
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1], want_g)
    assert dd.remat_count(client) == 0
    assert dd.peak_live(client) == _per_stage_peaks(sched, p, m)


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 3, 5), ("gpipe", 2, 3), ("zb-h1", 2, 4)])
def test_a_step_runs_the_compiled_schedule_in_order(schedule: str, p: int, m: int) -> None:
    """The lowering follows `dd.compile_schedule`: on each stage's worker, the step's
    layer actions ranked by their priorities are that worker's compiled order (less the
    actions that have no task there: stage 0's I, which no input needs, and a backward
    fused into the loss's forward)."""
    params, x, t = data(p, batch=2 * m)
    loss, _ = dd.value_and_grad(make_loss(p), microbatches=m, schedule=schedule)(params, x, t)
    graph = loss.__dask_graph__()
    prio = {}
    for layer in graph.layers.values():
        rank = (layer.annotations or {}).get("priority")
        for k in layer:
            info = dd.key_info(k)
            if info.phase in ("F", "B", "I", "W") and rank is not None:
                prio[k] = (rank(k), info)
    prog = dd.compile_schedule(schedule, p, m)
    for w, acts in enumerate(prog.workers):
        ranked = sorted((v for v in prio.values() if v[1].stage == w), key=lambda v: -v[0])
        seen: list[tuple[str, int]] = []
        for _, info in ranked:
            if not seen or seen[-1] != (info.phase, info.microbatch):
                seen.append((info.phase, info.microbatch))
        assert len(seen) >= len(acts) - m
        assert seen == [(a.kind, a.microbatch) for a in acts
                        if (a.kind, a.microbatch) in set(seen)], w
