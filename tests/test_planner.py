"""The planner: simulate on per-stage costs (against the uniform results and hand-computed
timelines), dd.predict / dd.best_schedule on profiles (peak live, memory, limits, wrong
inputs), stages=profile, and dd.profile of a real step on the 2-worker cluster."""
from __future__ import annotations

from typing import Any

import dask
import jax
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.inspect.record import Recording, TaskRecord
from dagdiff.plan.costs import LayerCost, StageProfile
from dagdiff.plan.measure import hop_samples, stage_actions
from dagdiff.plan.predict import timeline
from dagdiff.schedules import SCHEDULES, get_schedule, simulate
from tests import models as M

KEY = jax.random.PRNGKey(3)

# (schedule, p, m): every built-in, each on a layout it accepts
CASES = [("gpipe", 3, 4), ("1f1b", 4, 6), ("1f1b", 2, 1), ("interleaved", 2, 4),
         ("zb-h1", 3, 5), ("looped-bfs", 3, 2), ("interleaved-zb", 2, 3), ("zb-v", 3, 4),
         ("dualpipev", 2, 5)]


# ----------------------------------------------------------------- simulate, per stage

@pytest.mark.parametrize("name,p,m", CASES)
@pytest.mark.parametrize("comm", [0.0, 0.5])
def test_per_stage_costs_equal_to_uniform_give_the_old_results(name: str, p: int, m: int,
                                                               comm: float) -> None:
    sched = get_schedule(name)
    v = sched.virtual_stages
    f, b, i, w = 1.0, 2.0, 0.8, 1.2
    old = simulate(sched, p, m, f=f, b=b, i=i, w=w, comm=comm)
    per = {g: {"F": f / v, "B": b / v, "I": i / v, "W": w / v} for g in range(p * v)}
    edges = {(g - 1, g): comm for g in range(1, p * v)}
    edges.update({(g, g - 1): comm for g in range(1, p * v)})
    assert simulate(sched, p, m, stage_costs=per, edge_comm=edges) == old
    assert simulate(sched, p, m, f=f, b=b, i=i, w=w, comm=comm, stage_costs={}) == old


def test_two_unequal_stages_1f1b_by_hand() -> None:
    # stage 0: F = 1, B = 2; stage 1: F = 3, B = 4; m = 2.
    # worker 0 runs F0 F1 B0 B1, worker 1 runs F0 B0 F1 B1 (1F1B, p = 2):
    # w0 F0 [0, 1], F1 [1, 2]; w1 F0 [1, 4], B0 [4, 8], F1 [8, 11], B1 [11, 15];
    # w0 B0 [8, 10] (needs B0 of stage 1), B1 [15, 17]  -> makespan 17
    costs = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 3.0, "B": 4.0}}
    res = simulate("1f1b", 2, 2, stage_costs=costs)
    assert res.makespan == 17.0
    assert res.spans == (
        (("F0", 0.0, 1.0), ("F1", 1.0, 2.0), ("B0", 8.0, 10.0), ("B1", 15.0, 17.0)),
        (("F0", 1.0, 4.0), ("B0", 4.0, 8.0), ("F1", 8.0, 11.0), ("B1", 11.0, 15.0)))
    assert res.busy == (6.0, 14.0)
    assert res.bubble_fraction == pytest.approx(1 - 20 / 34)
    # hops: 0.5 forward (0 -> 1), 0.25 back (1 -> 0): w1 F0 [1.5, 4.5], B0 [4.5, 8.5],
    # F1 [8.5, 11.5], B1 [11.5, 15.5]; w0 B0 [8.75, 10.75], B1 [15.75, 17.75]
    res = simulate("1f1b", 2, 2, stage_costs=costs, edge_comm={(0, 1): 0.5, (1, 0): 0.25})
    assert res.makespan == 17.75
    assert res.spans[0][2] == ("B0", 8.75, 10.75)
    # GPipe, same costs: w1 F0 [1, 4], F1 [4, 7], B0 [7, 11], B1 [11, 15]; w0 B0 [11, 13],
    # B1 [15, 17]
    res = simulate("gpipe", 2, 2, stage_costs=costs)
    assert res.makespan == 17.0 and res.spans[0][2] == ("B0", 11.0, 13.0)


def test_two_unequal_stages_zb_h1_by_hand() -> None:
    # stage 0: F = I = W = 1; stage 1: F = 2, I = 2, W = 1; m = 2.
    # w0: F0 F1 I0 W0 I1 W1; w1: F0 I0 F1 I1 W0 W1.
    # w1 F0 [1, 3], I0 [3, 5], F1 [5, 7], I1 [7, 9], W0 [9, 10], W1 [10, 11];
    # w0 F0 [0, 1], F1 [1, 2], I0 [5, 6], W0 [6, 7], I1 [9, 10], W1 [10, 11] -> 11
    costs = {0: {"F": 1.0, "I": 1.0, "W": 1.0}, 1: {"F": 2.0, "I": 2.0, "W": 1.0}}
    res = simulate("zb-h1", 2, 2, stage_costs=costs)
    assert res.makespan == 11.0
    assert [s[1:] for s in res.spans[0]] == [(0, 1), (1, 2), (5, 6), (6, 7), (9, 10), (10, 11)]
    # a kind left out is derived: B = I + W, I = W = B / 2
    derived = simulate("1f1b", 2, 2, stage_costs={0: {"F": 1.0, "I": 1.0, "W": 1.0},
                                                  1: {"F": 3.0, "I": 1.5, "W": 2.5}})
    assert derived == simulate("1f1b", 2, 2, stage_costs={0: {"F": 1.0, "B": 2.0},
                                                          1: {"F": 3.0, "B": 4.0}})
    half = simulate("zb-h1", 2, 2, stage_costs={0: {"F": 1.0, "B": 2.0},
                                                1: {"F": 2.0, "B": 3.0}})
    assert half == simulate("zb-h1", 2, 2, stage_costs={0: {"F": 1.0, "I": 1.0, "W": 1.0},
                                                        1: {"F": 2.0, "I": 1.5, "W": 1.5}})


@pytest.mark.parametrize("kwargs,match", [
    ({"stage_costs": {2: {"F": 1.0}}}, r"stage\(s\) \[2\] outside.*0\.\.1"),
    ({"stage_costs": {0: {"X": 1.0}}}, r"unknown kind.*'X'"),
    ({"stage_costs": {0: {"F": -1.0}}}, r"F of stage 0=-1.0 is not a number >= 0"),
    ({"stage_costs": [1.0, 2.0]}, r"stage_costs must be a mapping"),
    ({"edge_comm": {(0, 5): 1.0}}, r"edge_comm key \(0, 5\)"),
    ({"edge_comm": {(0, 1): -2}}, r"comm of edge \(0, 1\)=-2"),
])
def test_bad_per_stage_costs_say_what_is_wrong(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(dd.ScheduleError, match=match):
        simulate("1f1b", 2, 2, **kwargs)


# ----------------------------------------------------------------- predict on profiles

def fake_profile(num_stages: int = 2, workers: int | None = None, m: int = 4,
                 f: tuple[float, ...] | None = None, act: int = 1000, params: int = 5000,
                 hop: float = 0.001) -> dd.Profile:
    """A Profile built by hand: stage g has F = f[g], B = 2F, I = W = F; one dense layer
    per stage; `act` activation bytes and `params` parameter bytes per stage."""
    f = f or tuple(0.01 * (1 + g % 2) for g in range(num_stages))
    stages = tuple(StageProfile(
        stage=g, worker=f"slot{g}", f=f[g], b=2 * f[g], i=f[g], w=f[g],
        send_forward=400 if g + 1 < num_stages else 0, send_backward=400 if g else 0,
        activation_bytes=act, param_bytes=params, layers=("dense",), samples=m)
        for g in range(num_stages))
    return dd.Profile(stages=stages, workers=workers or num_stages, microbatches=m,
                      hop_latency=hop, hop_bytes=400, hop_samples=3, bandwidth=None,
                      layers=tuple(LayerCost("dense", g, 3 * f[g], 1.0)
                                   for g in range(num_stages)),
                      schedules=("1f1b", "zb-h1"),
                      edges=tuple((g, g + 1, 400) for g in range(num_stages - 1))
                      + tuple((g + 1, g, 400) for g in range(num_stages - 1)))


@pytest.mark.parametrize("name,p,m", CASES)
def test_predict_peak_live_is_the_schedules(name: str, p: int, m: int) -> None:
    sched = get_schedule(name)
    prof = fake_profile(p * sched.virtual_stages, workers=p, m=m)
    pred = dd.predict(name, prof)
    assert list(pred.peak_live) == sched.peak_live(p, m)
    assert pred.microbatches == m and pred.workers == p and pred.schedule == sched.name
    # the simulator on the profile's costs, comm = the measured hop on every edge
    want = simulate(sched, p, m, stage_costs=prof.stage_costs(), comm=0.001)
    assert pred.makespan == pytest.approx(want.makespan)
    assert pred.spans == want.spans
    # memory: at least the parameters, their gradient sums and the live microbatches'
    # activations at the peak (the exact figures by hand: test_memory.py)
    per_worker = sched.virtual_stages
    assert all(mem >= 2 * 5000 * per_worker + act
               for mem, act in zip(pred.memory, pred.activation_bytes))
    assert "Prediction" in repr(pred) and "<table>" in pred._repr_html_()


def test_predict_scales_to_other_microbatch_counts() -> None:
    prof = fake_profile(2, m=4, hop=0.0)
    at8 = dd.predict("gpipe", prof, microbatches=8)
    # half the microbatch: half the time per action, (8 + 1) actions of each kind
    assert at8.makespan == pytest.approx(simulate(
        "gpipe", 2, 8, stage_costs={0: {"F": 0.005, "B": 0.01}, 1: {"F": 0.01, "B": 0.02}}
    ).makespan)
    # microbatches of half size: at the peak (the second backward's accumulation) 6 live
    assert max(at8.activation_bytes) == 500 * 6 and max(at8.peak_live) == 8


def test_best_schedule_ranks_and_respects_the_memory_limit() -> None:
    prof = fake_profile(2, m=8)
    ranked = dd.best_schedule(prof, microbatches=(4, 8))
    names = {(n, m) for n, m, _ in ranked}
    assert names == {(n, m) for n in ("gpipe", "1f1b", "zb-h1") for m in (4, 8)}
    spans = [p.makespan for _, _, p in ranked]
    assert spans == sorted(spans)
    # GPipe at m = 8, by hand: parameters 5000, 8 live microbatches of 1000; the second
    # backward's accumulation holds the first sum, its gradients and the new sum
    # (3 x 5000) beside the 6 microbatches still live: 5000 + 15000 + 6000
    gpipe8 = next(p for n, m, p in ranked if (n, m) == ("gpipe", 8))
    assert gpipe8.memory == (26_000, 26_000)
    limit = max(max(p.memory) for n, m, p in ranked if (n, m) in (("1f1b", 8), ("zb-h1", 8)))
    assert gpipe8.peak_memory > limit
    kept = dd.best_schedule(prof, microbatches=(4, 8), memory_limit=limit)
    assert kept and all(p.peak_memory <= limit for _, _, p in kept)
    assert ("gpipe", 8) not in {(n, m) for n, m, _ in kept}
    assert {n for n, _, _ in kept} >= {"1f1b", "zb-h1"}
    with pytest.raises(dd.ArgumentError, match=r"no schedule fits.*memory_limit=100"):
        dd.best_schedule(prof, memory_limit=100)
    assert dd.best_schedule(prof, memory_limit="1 MB")
    # two stages per worker: the schedules with virtual stages
    two = dd.best_schedule(fake_profile(4, workers=2, m=4))
    assert {n for n, _, _ in two} == {"interleaved", "looped-bfs", "interleaved-zb", "zb-v",
                                      "dualpipev"}
    six = dd.best_schedule(fake_profile(6, workers=2, m=4))   # three per worker
    assert {p.virtual_stages for _, _, p in six} == {3}
    assert set(SCHEDULES) >= {n for n, _, _ in two}


def test_wrong_inputs_name_the_problem() -> None:
    two = fake_profile(2)
    with pytest.raises(dd.ScheduleError, match=r"'1f1b'.*4 workers lays out 4 stages.*"
                                               r"profile has 2 stages.*fix"):
        dd.predict("1f1b", two, workers=4)
    with pytest.raises(dd.ScheduleError, match=r"'interleaved'.*lays out 4 stages.*2 stages"):
        dd.predict("interleaved", two)
    with pytest.raises(dd.ScheduleError, match=r"unknown schedule 'nope'"):
        dd.predict("nope", two)
    with pytest.raises(dd.ScheduleError, match=r"multiple of num_stages"):
        dd.predict("interleaved", fake_profile(4, workers=2, m=4), microbatches=3)
    with pytest.raises(dd.ArgumentError, match=r"takes a dd.Profile"):
        dd.predict("1f1b", {"F": 1.0})
    with pytest.raises(dd.ArgumentError, match=r"microbatches must be a positive int or an "
                                               r"iterable of them"):
        dd.best_schedule(two, microbatches=(0,))
    # NumPy's ints are ints (np.int64 raised "'numpy.int64' object is not iterable")
    assert [r[:2] for r in dd.best_schedule(two, microbatches=np.int64(4))] == \
        [r[:2] for r in dd.best_schedule(two, microbatches=4)]
    assert dd.best_schedule(two, microbatches=np.arange(4, 5))
    with pytest.raises(dd.ArgumentError, match=r"memory_limit must be positive bytes"):
        dd.best_schedule(two, memory_limit=-1)
    with pytest.raises(dd.ArgumentError, match=r"memory_limit must be bytes"):
        dd.best_schedule(two, memory_limit="lots")
    with pytest.raises(dd.ArgumentError, match=r"no schedule fits.*lays out") as info:
        dd.best_schedule(fake_profile(3, workers=2))
    assert "raise memory_limit" not in str(info.value)      # memory was not the reason
    with pytest.raises(dd.ArgumentError, match=r"no F/B/I/W action"):
        dd.Profile.from_recording(Recording(), _fake_build())


def _fake_build() -> Any:
    from dagdiff.build import Options, build

    params = M.init_dense(KEY, [4, 4, 4])
    x = np.ones((4, 4), np.float32)

    def fn(params: Any, x: Any) -> Any:
        with dd.stage(0):
            h = M.dense(params[0], x)
        with dd.stage(1):
            return M.mse(M.dense(params[1], h), x)
    return build(fn, (params, x), {}, Options.make("test", microbatches=2, schedule="1f1b"))


# ----------------------------------------------------------------- reading recordings

def test_stage_actions_fold_a_programs_small_tasks_into_its_actions() -> None:
    def t(key: str, w: str, a: float, b: float, phase: str, stage: Any, mb: Any) -> TaskRecord:
        return TaskRecord(key, w, a, b, phase, None, stage, mb)
    tasks = [
        t("split", "a", 0.0, 0.5, "split", None, 0), t("f", "a", 0.5, 2.5, "F", 0, 0),
        t("b", "a", 9.0, 12.0, "B", 0, 0), t("acc", "a", 12.0, 12.25, "acc", 0, 0),
        t("done", "a", 13.0, 13.1, "done", None, None),
        t("acc", "a", 14.0, 15.0, "acc", 0, 0),          # an output task after the program
        t("f1", "b", 4.0, 6.0, "F", 1, 0), t("loss", "b", 6.0, 6.5, "loss", None, 0),
        t("b1", "b", 6.5, 8.0, "B", 1, 0),
    ]
    rec = Recording(tasks=tasks, worker_names={"a": "slot0", "b": "slot1"})
    acts = stage_actions(rec)
    assert acts[("F", 0, 0)] == ("a", 0.5, 2.5, 2.5, ((0.0, 0.5), (0.5, 2.5)))  # + split
    assert acts[("B", 0, 0)] == ("a", 9.0, 12.0, 3.25, ((9.0, 12.0), (12.0, 12.25)))  # + acc
    assert acts[("F", 1, 0)].cost == 2.5                      # + loss
    # worker b waited for F at stage 0 (idle since the start): 1.5; worker a waited for
    # B at stage 1 (its previous task ended at 2.5 < 8.0): 1.0
    assert sorted(hop_samples(rec, acts, 2, {(0, 1): 64, (1, 0): 64})) == [(1.0, 64),
                                                                           (1.5, 64)]


# ----------------------------------------------------------------- stages=profile

def unstaged(params: Any, x: Any, t: Any) -> Any:
    h = x
    for p in params:
        h = M.dense(p, h)
    return M.mse(h, t)


def test_stages_profile_balances_by_measured_times() -> None:
    params = M.init_dense(KEY, [8] * 5)
    x = jax.random.normal(KEY, (8, 8))
    t = jax.random.normal(jax.random.fold_in(KEY, 1), (8, 8))
    costs = [1.0, 1.0, 1.0, 5.0, 0.0]                  # the 4th layer is slow
    prof = dataclass_replace(fake_profile(2), layers=tuple(
        LayerCost(n, 0, c, 1.0) for n, c in zip(["dense"] * 4 + ["mse"], costs)))
    g = dd.trace(unstaged, microbatches=2, schedule="1f1b", stages=prof, fuse=False)(params, x, t)
    stages = [n.stage for n in g.build.model.trace.nodes if n.kind == "call"]
    assert stages == [0, 0, 0, 1, 1]
    loss, grads = dd.value_and_grad(unstaged, microbatches=2, schedule="1f1b",
                                    stages=prof)(params, x, t)
    got = dask.compute(grads, scheduler="sync")[0]
    for a, b in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(jax.grad(unstaged)(params, x, t))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(dd.ArgumentError, match=r"5 layer calls.*dense x4, mse.*this one has "
                                               r"4.*profile this model"):
        dd.value_and_grad(unstaged, microbatches=2, stages=prof)(params[:3], x, t)
    with pytest.raises(dd.ArgumentError, match=r"stages must be 'auto'.*dd.Profile"):
        dd.value_and_grad(unstaged, stages=[1, 2])


def dataclass_replace(obj: Any, **changes: Any) -> Any:
    import dataclasses
    return dataclasses.replace(obj, **changes)


# ----------------------------------------------------------------- a real step

staged_loss = M.staged_loss


@pytest.fixture(scope="module")
def real_profile(client2: Any) -> dd.Profile:
    params = M.init_dense(KEY, [32] * 5)
    x = jax.random.normal(KEY, (32, 32))
    t = jax.random.normal(jax.random.fold_in(KEY, 1), (32, 32))
    # 5 recorded steps per schedule: with 8-row microbatches of a 32-wide model, whether a
    # consumer waits on its hop (a hop sample) is up to timing in any one step
    return dd.profile(staged_loss, microbatches=4, client=client2, steps=5)(params, x, t)


@pytest.mark.distributed
def test_a_profile_that_measured_no_hop_says_so(client2: Any, monkeypatch: Any) -> None:
    """A profile in which no action was seen waiting for another worker's value (the
    workers' clocks disagreeing by more than a hop: 2 of 8 profiles of a small model here)
    has hop_latency 0, which dd.predict takes as free hops: it warns, saying how to set
    the hop."""
    from dagdiff.plan import costs

    monkeypatch.setattr(costs, "hop_samples", lambda *a, **k: [])
    params = M.init_dense(KEY, [8] * 3)
    x = jax.random.normal(KEY, (8, 8))
    with pytest.warns(RuntimeWarning, match="(?s)no hop between workers.*hop_latency"):
        prof = dd.profile(staged_loss, microbatches=2, client=client2, steps=1,
                          schedules=("1f1b",))(params, x, x)
    assert prof.hop_samples == 0 and prof.hop_latency == 0.0


def test_profile_of_a_real_step(real_profile: dd.Profile) -> None:
    prof = real_profile
    assert prof.num_stages == 2 and prof.workers == 2 and prof.microbatches == 4
    assert prof.schedules == ("1f1b", "zb-h1")
    for s in prof.stages:
        assert s.f > 0 and s.b > 0 and s.w > 0, s
        # stage 0's input is data: a split backward computes no input gradient there
        assert s.i > 0 if s.stage else s.i == 0.0, s
        assert s.samples >= 4 and s.param_bytes == 2 * (32 * 32 + 32) * 4
        assert s.layers == (("dense", "dense") if s.stage == 0 else ("dense", "dense", "mse"))
    assert prof.stages[0].send_forward == 8 * 32 * 4 == prof.stages[1].send_backward
    # kept per live microbatch (8 x 32 floats = 1 KiB a value): stage 0 x, h1, h2;
    # stage 1 h2, h3, h4, t and the loss
    assert [s.activation_bytes for s in prof.stages] == [3 * 1024, 4 * 1024 + 4]
    assert prof.hop_latency > 0 and prof.hop_samples > 0 and prof.hop_bytes == 8 * 32 * 4
    assert prof.bandwidth is None or prof.bandwidth > 0
    assert 0.0 <= prof.contention <= 1.0 and prof.hosts == ("127.0.0.1", "127.0.0.1")
    assert [c.name for c in prof.layers] == ["dense"] * 4 + ["mse"]
    assert "Profile: 2 stages on 2 workers" in repr(prof) and "<table>" in prof._repr_html_()
    pred = dd.predict("1f1b", prof)
    assert pred.makespan > 0 and list(pred.peak_live) == [2, 1]
    best = dd.best_schedule(prof, microbatches=(2, 4))
    assert {n for n, _, _ in best} == {"gpipe", "1f1b", "zb-h1"}
    # counts the profiled batch (32 rows) does not split into are left out, saying why
    # (best_schedule ranked m=64 first: half a row a microbatch, refused by every step)
    assert prof.batch_rows == 32
    best = dd.best_schedule(prof, microbatches=(4, 5, 64))
    assert {m for _, m, _ in best} == {4}
    with pytest.raises(dd.MicrobatchError, match="32 rows does not split into 5"):
        dd.predict("1f1b", prof, microbatches=5)
    with pytest.raises(dd.ArgumentError, match=r"m=64: the profiled batch of 32 rows"):
        dd.best_schedule(prof, microbatches=(5, 64))


def test_prediction_timeline_draws_both(real_profile: dd.Profile, client2: Any,
                                        tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    params = M.init_dense(KEY, [32] * 5)
    x = jax.random.normal(KEY, (32, 32))
    t = jax.random.normal(jax.random.fold_in(KEY, 1), (32, 32))
    with client2.as_current():
        loss, _ = dd.value_and_grad(staged_loss, microbatches=4, schedule="1f1b")(params, x, t)
        with dd.record(client2) as rec:
            client2.compute(loss, sync=True)
    pred = dd.predict("1f1b", real_profile)
    path = tmp_path / "pred.png"
    fig = pred.timeline(rec, path=str(path))
    assert path.stat().st_size > 0 and len(fig.axes) == 2
    assert len(timeline(pred).axes) == 1


# ----------------------------------------------------------------- contention

def test_contention_shares_a_host_by_hand() -> None:
    # 1F1B, p = 2, m = 2, F = B = 1 everywhere. contention 1: two busy workers each run
    # at half speed. t 0-1 w0 F0 alone; 1-3 w0 F1 and w1 F0 together; 3-4 w1 B0 alone;
    # 4-6 w0 B0 and w1 F1 together; 6-7 w1 B1; 7-8 w0 B1  -> 8 (6 without contention)
    costs = {0: {"F": 1.0, "B": 1.0}, 1: {"F": 1.0, "B": 1.0}}
    assert simulate("1f1b", 2, 2, stage_costs=costs).makespan == 6.0
    res = simulate("1f1b", 2, 2, stage_costs=costs, contention=1.0)
    assert res.makespan == 8.0
    assert res.spans[1] == (("F0", 1.0, 3.0), ("B0", 3.0, 4.0), ("F1", 4.0, 6.0),
                            ("B1", 6.0, 7.0))
    assert res.busy == (6.0, 6.0)
    # contention 0.5: together each runs at 1 / 1.5 -> 1 + 1.5 + 1 + 1.5 + 1 + 1 = 7
    assert simulate("1f1b", 2, 2, stage_costs=costs, contention=0.5).makespan == 7.0
    # on two hosts nothing is shared
    assert simulate("1f1b", 2, 2, stage_costs=costs, contention=1.0,
                    hosts=["a", "b"]).makespan == 6.0
    with pytest.raises(dd.ScheduleError, match=r"hosts names 3 hosts for 2 workers"):
        simulate("1f1b", 2, 2, contention=1.0, hosts=["a", "b", "c"])
    with pytest.raises(dd.ScheduleError, match=r"contention=-1"):
        simulate("1f1b", 2, 2, contention=-1)


@pytest.mark.parametrize("name,p,m", CASES)
def test_vanishing_contention_is_the_plain_simulation(name: str, p: int, m: int) -> None:
    plain = simulate(name, p, m, f=1.0, b=2.0, comm=0.25)
    shared = simulate(name, p, m, f=1.0, b=2.0, comm=0.25, contention=1e-12)
    assert shared.makespan == pytest.approx(plain.makespan)
    assert [[a for a, _, _ in w] for w in shared.spans] == [[a for a, _, _ in w]
                                                            for w in plain.spans]


def test_fit_contention_finds_an_even_share() -> None:
    from dagdiff.plan.measure import fit_contention, overlap_segments, work

    # every action has 1 s of work: alone it takes 1 s, next to the other worker 2 s
    def t(w: str, a: float, b: float, k: str, g: int, mb: int) -> TaskRecord:
        return TaskRecord(f"{k}{g}{mb}", w, a, b, k, None, g, mb)
    tasks = [t("a", 0, 1, "F", 0, 0), t("a", 1, 3, "F", 0, 1), t("b", 1, 3, "F", 1, 0),
             t("b", 3, 4, "B", 1, 0), t("a", 4, 6, "B", 0, 0), t("b", 4, 6, "F", 1, 1),
             t("b", 6, 7, "B", 1, 1), t("a", 7, 8, "B", 0, 1)]
    acts = stage_actions(Recording(tasks=tasks))
    segs = overlap_segments(acts)
    assert segs[("F", 0, 1)] == [(2.0, 2)] and segs[("F", 0, 0)] == [(1.0, 1)]
    assert fit_contention([segs]) == 1.0
    assert all(work(s, 1.0) == pytest.approx(1.0) for s in segs.values())
    # on different hosts nothing overlaps: no contention to fit
    assert fit_contention([overlap_segments(acts, host_of=lambda w: w)]) == 0.0


def test_predict_uses_the_profiles_contention_and_hosts() -> None:
    prof = dataclass_replace(fake_profile(2, m=4, hop=0.0), contention=1.0,
                             hosts=("10.0.0.1", "10.0.0.1"))
    shared = dd.predict("1f1b", prof)
    want = simulate("1f1b", 2, 4, stage_costs=prof.stage_costs(), contention=1.0)
    assert shared.makespan == pytest.approx(want.makespan)
    assert shared.makespan > dd.predict("1f1b", fake_profile(2, m=4, hop=0.0)).makespan
    apart = dataclass_replace(prof, hosts=("10.0.0.1", "10.0.0.2"))   # nothing shared
    assert dd.predict("1f1b", apart).makespan == pytest.approx(
        dd.predict("1f1b", fake_profile(2, m=4, hop=0.0)).makespan)


def test_profile_options_fail_at_once() -> None:
    with pytest.raises(dd.ArgumentError, match=r"dd.profile: microbatches must be a positive"):
        dd.profile(staged_loss, microbatches=0)
    with pytest.raises(dd.ArgumentError, match=r"warmup must be an int >= 0"):
        dd.profile(staged_loss, steps=0)
    with pytest.raises(dd.ScheduleError, match=r"unknown schedule 'nope'"):
        dd.profile(staged_loss, schedules=("nope",))
    with pytest.raises(dd.ArgumentError, match=r"needs a distributed client"):
        dd.profile(staged_loss, microbatches=2, client=object())(M.init_dense(KEY, [4, 4, 4]),
                                                                 np.ones((4, 4), np.float32),
                                                                 np.ones((4, 4), np.float32))


@pytest.mark.distributed
def test_profile_times_the_loss_stage_forward_and_backward_apart(client2: Any) -> None:
    """1F1B runs the loss stage's forward and backward as one call; the profile must still
    see them apart (sleep stages: F 10 ms, B = I + W 20 ms), or predictions for other
    schedules would move the last stage's backward into its forwards."""
    from dagdiff.examples.simulated import sleepy_pipeline

    fn = sleepy_pipeline(2, 0.01)
    params = [np.float32(1.0)] * 3
    prof = dd.profile(fn, microbatches=4, schedules=("1f1b",), client=client2, steps=2,
                      bandwidth=False)(params, np.ones((8, 8), np.float32))
    last = prof.stages[1]
    assert last.samples >= 8 and last.b > 1.2 * last.f, last   # fused: B ~0, F ~3x
