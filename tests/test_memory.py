"""Memory as a planned resource: recomputation policies per stage (gradients equal
jax.value_and_grad's), residual bytes against hand counts, the memory model by hand,
measured peaks on a cluster against the prediction, the planner choosing policies under
a limit, and a step refused before it runs out of memory."""
from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from distributed import Client

import dagdiff as dd
from dagdiff.build import Options, trace_model
from dagdiff.core.footprint import stage_footprints
from dagdiff.lowering.memory import loss_fused, step_memory
from dagdiff.plan.costs import StageProfile
from dagdiff.schedules import get_schedule
from dagdiff.schedules.memory import memory_peaks
from tests import models as M

KEY = jax.random.PRNGKey(0)


def staged(n_stages: int, n_layers: int) -> Any:
    def loss(params: Any, x: Any, t: Any) -> Any:
        h = x
        for i, p in enumerate(params):
            with dd.stage(i * n_stages // n_layers):
                h = M.dense(p, h)
        with dd.stage(n_stages - 1):
            return M.mse(h, t)
    return loss


def _unstaged(params: Any, x: Any, t: Any) -> Any:
    h = x
    for p in params:
        h = M.dense(p, h)
    return M.mse(h, t)


def mlp(width: int, batch: int, layers: int) -> tuple[Any, Any, Any]:
    params = M.init_dense(KEY, [width] * (layers + 1))
    x = jax.random.normal(jax.random.fold_in(KEY, 1), (batch, width))
    t = jax.random.normal(jax.random.fold_in(KEY, 2), (batch, width))
    return params, x, t


# ------------------------------------------------------------------ policies: gradients

@pytest.mark.parametrize("remat", ["none", "selective", "full", {0: "full", 1: "selective"},
                                   {1: "full"}])
@pytest.mark.parametrize("pipe", [{}, {"microbatches": 4, "schedule": "1f1b"},
                                  {"microbatches": 4, "schedule": "zb-h1"}])
def test_policies_give_jax_gradients(remat: Any, pipe: dict[str, Any]) -> None:
    loss = staged(2, 4)
    args = mlp(8, 16, 4)
    dd.reset_remat_count()
    got_l, got_g = dd.value_and_grad(loss, remat=remat, **pipe).compute(*args)
    M.assert_matches_jax(loss, args, got_l, got_g)
    assert dd.remat_count() == 0        # recomputing on purpose is not a moved pullback


def test_policy_changes_the_keys_and_bad_policies_say_so() -> None:
    loss = staged(2, 4)
    args = mlp(8, 16, 4)
    a = dd.value_and_grad(loss, microbatches=2, schedule="1f1b")(*args)[0]
    b = dd.value_and_grad(loss, microbatches=2, schedule="1f1b", remat="full")(*args)[0]
    assert a.key != b.key
    for bad, match in [("some", "remat must be one of 'none', 'full', 'selective'"),
                       ({"a": "full"}, "keys of remat are stages"),
                       ({0: "half"}, r"remat\[0\] must be one of"), (3, "got int 3")]:
        with pytest.raises(dd.ArgumentError, match=match):
            dd.value_and_grad(loss, remat=bad)
        with pytest.raises(dd.ArgumentError, match=match):
            dd.Trainer(loss, optax.sgd(0.1), remat=bad)
    # a stage the model does not have (a typo would leave the meant stage without its
    # policy: it was accepted and ignored), and per-stage policies for an unstaged model
    with pytest.raises(dd.ArgumentError, match=r"remat names stage\(s\) \[2\].*stages \[0, 1\]"):
        dd.value_and_grad(loss, microbatches=2, schedule="1f1b", remat={2: "full"})(*args)
    with pytest.raises(dd.ArgumentError, match="the model has no stages"):
        dd.value_and_grad(_unstaged, remat={0: "full"})(*args)


def test_trainer_with_a_policy_per_stage_equals_optax() -> None:
    loss = staged(2, 4)
    params, x, t = mlp(8, 16, 4)
    batches = [(x, t)] * 3
    opt = optax.sgd(0.1)
    trainer = dd.Trainer(loss, opt, microbatches=4, schedule="1f1b",
                         remat={0: "full", 1: "selective"})
    state = trainer.init(params)
    for b in batches:
        state, _ = trainer.step(state, *b)
    want, _ = M.optax_reference(loss, opt, params, batches)
    M.close(trainer.params(state), want)


# ------------------------------------------------------------------ bytes by hand
def traced(stages: int, layers: int, schedule: Any, remat: Any = None) -> Any:
    """The traced model of `staged(stages, layers)` on 16-wide layers, batch 32 in 4
    microbatches (8 x 16 float32: 512 bytes per activation)."""
    params, x, t = mlp(16, 32, layers)
    return trace_model(staged(stages, layers), (params, x, t), {},
                       Options.make("t", microbatches=4, schedule=schedule, remat=remat),
                       None)


def test_residual_bytes_by_hand() -> None:
    """One tanh dense layer per stage, microbatch (8, 16) float32 = 512 bytes per
    activation. A live microbatch of stage 0 keeps its output (512) and: without
    recomputation tanh's output and the product (JAX's VJP of tanh and of the sum keep
    both: 1024); selective, the product only (512); full, nothing. Its input is a view
    of the batch, which the step holds whole (`inputs`: one microbatch's 512)."""
    fps = stage_footprints(traced(2, 2, "1f1b").trace)
    act = 8 * 16 * 4
    assert fps[0].params == (16 * 16 + 16) * 4
    assert dict(fps[0].kept) == {"none": 3 * act, "selective": 2 * act, "full": act}
    assert fps[0].output == act and fps[1].output == 0
    assert fps[0].inputs == act and fps[1].inputs == act      # x, and the targets
    # the last stage (dense and the loss fused into one call) keeps its input from
    # stage 0 and the loss scalar when it recomputes
    assert dict(fps[1].kept)["full"] == act + 4


def _kept_by_runtime(trace: Any, node: Any, policy: str, fused: bool) -> int | None:
    """What `runtime.compiled` really keeps from a split backward's I for its W, run on
    arrays: the stash's arrays that are not the call's inputs, its pullback's leaves or
    its cotangents (those are held anyway); None where it does not split."""
    import numpy as np

    from dagdiff.core.remat import with_policy, without_policy
    from dagdiff.core.tracer import Traced
    from dagdiff.runtime.compiled import _Compiled

    spec = with_policy(without_policy(node.spec), policy)
    c = _Compiled(spec)
    rng = np.random.default_rng(0)
    dyn = [x for x, k in zip(node.in_leaves, node.spec.kinds) if k == "d"]
    vals = [jnp.asarray(rng.normal(size=x.aval.shape), x.aval.dtype) for x in dyn]
    d = [v for v, f in zip(vals, spec.diff) if f]
    nd = [v for v, f in zip(vals, spec.diff) if not f]
    param = [isinstance(x, Traced) and trace.nodes[x.node].kind == "param"
             for x, f in zip(dyn, spec.diff) if f]
    first = tuple(j for j, q in enumerate(param) if not q)
    second = tuple(j for j, q in enumerate(param) if q)
    if fused:
        got = c.fwd_grad_split(d, nd, [np.asarray(0.25, np.float32)], first, second)
        held = {id(v) for v in vals}
        stash = None if got is None else got[3]
    else:
        out, pb = c.fwd_vjp(d, nd)
        cts = [jnp.ones(o.shape, o.dtype) for o in out]
        got = c.split_bwd(pb, cts, first, second)
        held = {id(v) for v in [*jax.tree_util.tree_leaves(pb), *cts]}
        stash = None if got is None else got[2]
    if stash is None:
        return None
    return sum(int(x.nbytes) for x in stash if id(x) not in held and x.ndim)


def test_split_backward_stash_is_what_the_split_keeps() -> None:
    """Three stages of two tanh dense layers (ZB-H1), microbatch (8, 16) float32: 512
    bytes per activation. The middle stage's I leaves for its W the output cotangent its
    W task reads (512) and what the split carries: the two pre-activation cotangents
    (tanh' times the cotangent, 2 x 512; each layer's input is a pullback residual
    already). Under "selective" the backward holds a ``jax.checkpoint`` call and is not
    cut, under "full" there is no pullback: the cotangent alone. The loss's stage runs
    F and I as one call and carries its second layer's input and both pre-activation
    cotangents (3 x 512). The first stage has no I (its input is data): it holds its
    output cotangent until W. Each figure also equals the bytes `runtime.compiled`
    keeps, run on arrays."""
    m = traced(3, 6, "zb-h1")
    fps = stage_footprints(m.trace)
    act = 8 * 16 * 4
    assert dict(fps[1].stash) == {"none": 3 * act, "selective": act, "full": act}
    assert dict(fps[0].stash) == {"none": act, "selective": act, "full": act}
    assert fps[2].fused_stash_by("none") == 3 * act
    assert fps[2].fused_stash_by("selective") is None      # every gradient with F
    assert fps[1].returned == act and fps[2].returned == act and fps[0].returned == 0
    calls = {n.stage: n for n in m.trace.nodes if n.kind == "call"}
    assert _kept_by_runtime(m.trace, calls[1], "none", False) == 2 * act
    assert _kept_by_runtime(m.trace, calls[1], "selective", False) is None
    assert _kept_by_runtime(m.trace, calls[2], "none", True) == 3 * act
    assert _kept_by_runtime(m.trace, calls[2], "selective", True) is None
    # the loss's call runs F with I unless it recomputes (`lower` seeds no such call)
    sched = get_schedule("zb-h1")
    assert loss_fused(m.trace, sched, 4, 2) == {(2, mb) for mb in range(4)}
    full = traced(3, 6, sched, remat="full")
    assert loss_fused(full.trace, sched, 4, 2) == set()


def test_split_memory_model_by_hand() -> None:
    """ZB-H1, 2 workers, 2 microbatches, P = 1000 bytes of parameters and 1000 kept per
    live microbatch on each stage. Stage 0 (F0 F1 I0 W0 I1 W1) leaves 300 from I to W;
    the loss's stage (F0 I0 F1 I1 W0 W1) runs F with I, receives 200 and sends 200 back
    per microbatch, and carries 700 to W."""
    sched = get_schedule("zb-h1")
    params, kept = {0: 1000, 1: 1000}, {0: 1000, 1: 1000}
    common = dict(fused={(1, 0), (1, 1)}, stash={0: 300}, inside_calls=False,
                  received={1: 200}, returned={1: 200})
    w0, w1 = memory_peaks(sched, 2, 2, params, kept, fused_stash={1: 700}, **common)
    # W0 s0: P, two live microbatches, I0's stash and W0's gradients
    assert (w0.bytes, w0.at) == (1000 + 2000 + 300 + 1000, "W0 s0")
    # W0 s1: P, both fused forwards' carry, cotangents and inputs, W0's gradients
    assert (w1.bytes, w1.at) == (1000 + 2 * (700 + 200 + 200) + 1000, "W0 s1")
    # a backward that does not split: the fused forwards hold the gradients instead,
    # which W only hands on; the high point is the accumulation (4 P)
    _, w1 = memory_peaks(sched, 2, 2, params, kept, fused_stash={1: None}, **common)
    assert (w1.bytes, w1.at) == (4000, "acc1 s1")
    # 1F1B without fusion: a B's result holds the cotangents it sends back beside the
    # gradients until they are summed: 4 P + 500 at B1's accumulation
    _, w1 = memory_peaks(get_schedule("1f1b"), 2, 4, {0: 5000, 1: 5000}, kept,
                         returned={1: 500})
    assert (w1.bytes, w1.at) == (20_500, "acc1 s1")


def test_memory_model_by_hand() -> None:
    """1F1B, 2 workers, 4 microbatches, parameters P = 5000 and 1000 bytes kept per live
    microbatch on each stage; the loss's stage runs F and B as one call."""
    sched = get_schedule("1f1b")
    params, kept = {0: 5000, 1: 5000}, {0: 1000, 1: 1000}
    w0, w1 = memory_peaks(sched, 2, 4, params, kept, fused={(1, mb) for mb in range(4)})
    # worker 0 runs F0 F1 B0 F2 B1 ...: at B1's accumulation it holds P, the first sum,
    # B1's gradients and the new sum (4 P) and F2's microbatch: 21000
    assert (w0.bytes, w0.at, w0.live) == (21_000, "acc1 s0", 1)
    # worker 1 never keeps a microbatch; its fused forwards hold their gradients
    assert (w1.bytes, w1.at, w1.live) == (20_000, "acc1 s1", 0)
    # GPipe keeps all four forwards before the first backward
    g0, _ = memory_peaks(get_schedule("gpipe"), 2, 4, params, kept)
    assert g0.bytes == 5000 + 15_000 + 2000


def test_values_from_other_workers_count_from_their_arrival() -> None:
    """1F1B, 2 workers, 4 microbatches, 1000 bytes kept per live microbatch, a 100-byte
    activation into stage 1 and a 50-byte cotangent back into stage 0. Run with F = 1,
    B = 2 and hops of 1: worker 0 ends F0 F1 B0 F2 B1 F3 B2 B3 at 1 2 8 9 11 12 16 19,
    worker 1 ends F0 B0 F1 B1 F2 B2 F3 B3 at 3 5 6 8 11 13 14 16; a value arrives 1
    after its sender ends."""
    sched = get_schedule("1f1b")
    params, kept = {0: 0, 1: 0}, {0: 1000, 1: 1000}
    late = memory_peaks(sched, 2, 4, params, kept, received={1: 100}, incoming={0: 50})
    assert [(pk.bytes, pk.at) for pk in late] == [(2000, "F1 s0"), (1000, "F0 s1")]
    w0, w1 = memory_peaks(sched, 2, 4, params, kept, received={1: 100}, incoming={0: 50},
                          arrivals=True)
    # B1's cotangent (sent at 8) is there at 9, as F2 ends: two live microbatches + it
    assert (w0.bytes, w0.at) == (2050, "F2 s0")
    # F1's activation (sent at 2) is there at 3, as F0 ends: held through F0 and B0
    assert (w1.bytes, w1.at) == (1100, "F0 s1")
    # GPipe: worker 1 holds the next F's input at the end of each F (1100, 2100, 3100,
    # then F3's 4000); worker 0's B0 ends at 11 as B1's cotangent comes
    g0, g1 = memory_peaks(get_schedule("gpipe"), 2, 4, params, kept, received={1: 100},
                          incoming={0: 50}, arrivals=True)
    assert [(g0.bytes, g0.at), (g1.bytes, g1.at)] == [(4050, "B0 s0"), (4000, "F3 s1")]


# ------------------------------------------------------------------ measured on a cluster

def test_record_measures_a_known_buffer() -> None:
    """Without a cluster: the recording's 'local' samples see a 16 MiB output."""
    @dd.layer
    def big(p: Any, x: Any) -> Any:
        return jnp.broadcast_to(jnp.tanh(x @ p["w"]).sum(), (2048, 2048))

    @dd.layer
    def total(y: Any) -> Any:
        return y.mean()

    params = {"w": jnp.ones((4, 4))}
    with dd.record() as rec:
        dd.value_and_grad(lambda p, x: total(big(p, x))).compute(params, jnp.ones((2, 4)))
    peak = rec.peak_memory()
    assert set(peak) == {"local"}
    assert peak["local"] >= 2048 * 2048 * 4
    assert "peak" in rec.memory_table()


@pytest.mark.slow
def test_measured_peaks_match_the_prediction_and_remat_lowers_them(client2: Any) -> None:
    """Measured (dd.record) against predicted (the same model's footprint over the
    schedule) per worker, GPipe and 1F1B, no / selective / full recomputation."""
    loss = staged(2, 4)
    args = mlp(256, 256, 4)
    measured: dict[tuple[str, str], dict[str, int]] = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        sched = get_schedule(name)
        for remat in ("none", "selective", "full"):
            step = dd.value_and_grad(loss, microbatches=8, schedule=sched, remat=remat)
            step.compute(*args, client=client2)         # compile
            with dd.record(client2) as rec:
                got_l, got_g = step.compute(*args, client=client2)
            M.assert_matches_jax(loss, args, got_l, got_g)
            peaks = rec.peak_memory()
            slots = {rec.worker_names[w]: n for w, n in peaks.items()}
            measured[(name, remat)] = slots
            model = trace_model(loss, args, {}, Options.make(
                "t", microbatches=8, schedule=sched, remat=remat), None)
            fps = stage_footprints(model.trace)
            pred = step_memory(fps, sched, 2, 8, remat,
                               loss_fused(model.trace, sched, 8, 1), inside_calls=False)
            for w in range(2):
                got = slots[f"slot{w}"]
                assert abs(pred[w].bytes - got) <= 0.10 * got, (name, remat, w, pred, slots)
    # GPipe keeps 8 microbatches: recomputing keeps measurably less on the first stage
    assert measured[("gpipe", "full")]["slot0"] < measured[("gpipe", "selective")]["slot0"] \
        < measured[("gpipe", "none")]["slot0"]
    assert measured[("1f1b", "none")]["slot0"] < measured[("gpipe", "none")]["slot0"]


@pytest.mark.slow
def test_step_peaks_tell_the_recorded_steps_apart() -> None:
    """Two 1F1B steps recorded in one block, the second on a batch 4x as large: each
    worker's peak during the second step is above its peak during the first, and
    neither is above the block's peak. On a cluster of its own: on the shared one,
    values other tests left behind can be released between the two steps (CI saw a
    worker's held bytes drop by more than the larger batch adds)."""
    from tests.conftest import _cluster_client
    clients = _cluster_client(2)
    try:
        _step_peaks_on(next(clients))
    finally:
        next(clients, None)                            # close the client and cluster


def _step_peaks_on(client2: Any) -> None:
    loss = staged(2, 4)
    small, large = mlp(128, 64, 4), mlp(128, 256, 4)
    step = dd.value_and_grad(loss, microbatches=4, schedule="1f1b")
    step.compute(*small, client=client2)
    step.compute(*large, client=client2)               # compile both
    with dd.record(client2) as rec:
        step.compute(*small, client=client2)
        got_l, got_g = step.compute(*large, client=client2)
    M.assert_matches_jax(loss, large, got_l, got_g)
    first, second = rec.step_peaks()
    assert set(first) == set(second) == set(rec.peak_memory())
    for w in first:
        assert second[w] > first[w], (w, first, second)
        assert max(first[w], second[w]) <= rec.peak_memory()[w]


@pytest.mark.distributed
def test_a_templates_steps_are_recorded_under_their_own_keys(client2: Any) -> None:
    """Two steps of one template (same shapes, other batches) recorded in one block:
    each action carries its own step's key (the token of that step's Delayed), not the
    template's first step's, so `step_peaks` tells the two steps apart (it saw one)."""
    loss = staged(2, 4)
    args = mlp(16, 8, 4)
    other = (args[0], args[1] + 1.0, args[2])
    step = dd.value_and_grad(loss, microbatches=4, schedule="1f1b")
    step.compute(args[0], args[1] - 1.0, args[2], client=client2)     # makes the template
    with dd.record(client2) as rec:
        step.compute(*args, client=client2)
        step.compute(*other, client=client2)
    with client2.as_current():
        want = {str(step(*a)[0].key).rsplit("-", 1)[-1] for a in (args, other)}
    got = {str(r.key).rsplit("-", 1)[-1] for r in rec.tasks if r.phase in ("F", "B")}
    assert got == want
    assert len(rec.step_peaks()) == 2


@pytest.mark.distributed
def test_step_peaks_count_steps_computed_again_and_trainer_steps(client2: Any) -> None:
    """One entry per recorded step: a step computed again on the same batch (same keys:
    it was one entry for three), and Trainer steps, whose replica's actions end in the
    step token's first 12 digits and their updates in the whole token (it was two
    entries a step, plus the tail of the step before the block)."""
    loss = staged(2, 4)
    args = mlp(16, 8, 4)
    step = dd.value_and_grad(loss, microbatches=4, schedule="1f1b")
    step.compute(*args, client=client2)
    with dd.record(client2) as rec:
        for _ in range(3):
            step.compute(*args, client=client2)
    assert len(rec.step_peaks()) == 3
    trainer = dd.Trainer(loss, optax.sgd(0.1), microbatches=4, schedule="1f1b",
                         client=client2)
    state = trainer.init(args[0])
    state, l0 = trainer.step(state, *args[1:])
    l0.result()
    with dd.record(client2) as rec:
        for i in range(3):
            state, loss_i = trainer.step(state, args[1] + i, args[2])
            loss_i.result()
    assert len(rec.step_peaks()) == 3


def test_accumulation_follows_the_schedules_backward_order() -> None:
    """looped-bfs runs a stage's backwards from the last microbatch down: its gradient
    sums chain in that order, so no microbatch's gradients wait for others."""
    sched = get_schedule("looped-bfs", virtual_stages=2)
    loss = staged(4, 4)
    args = mlp(8, 16, 4)
    graph = dd.trace(loss, microbatches=4, schedule=sched)(*args)
    dsk = graph.dsk
    from dagdiff.core.keys import key_info
    from dagdiff.runtime.taskspec import TaskRef

    chain: dict[int, list[tuple[int, int | None]]] = {}
    for k, task in dict(dsk).items():
        if isinstance(k, str) and k.startswith("acc_"):
            info = key_info(k)
            prev = task.args[2]
            chain.setdefault(info.stage, []).append(
                (info.microbatch, key_info(prev.key).microbatch
                 if isinstance(prev, TaskRef) else None))
    layout = sched.checked_layout(2)
    for w, acts in enumerate(sched.table(2, 4)):
        for c, g in enumerate(layout[w]):
            order = [a.microbatch for a in acts if a.kind == "B" and a.chunk == c]
            want = {(mb, order[i - 1] if i else None) for i, mb in enumerate(order)}
            assert set(chain[g]) == want, (g, order, chain[g])


# ------------------------------------------------------------------ planning under a limit

def profile_with_policies(m: int = 8) -> dd.Profile:
    """Two stages measured by hand: F = 10 ms, B = 20 ms; 1 MB of parameters; a live
    microbatch keeps 1 MB without recomputation, 0.5 MB selective (recomputing 10% of
    F), 0.1 MB full (recomputing F)."""
    stages = tuple(StageProfile(
        stage=g, worker=f"slot{g}", f=0.01, b=0.02, i=0.01, w=0.01, send_forward=1000,
        send_backward=1000, activation_bytes=10**6, param_bytes=10**6, layers=("dense",),
        samples=m, kept=(("none", 10**6), ("selective", 5 * 10**5), ("full", 10**5)),
        recompute=(("full", 1.0), ("selective", 0.1))) for g in range(2))
    return dd.Profile(stages=stages, workers=2, microbatches=m, hop_latency=0.0,
                      hop_bytes=1000, hop_samples=1, bandwidth=None, layers=(),
                      schedules=("1f1b",), edges=((0, 1, 1000), (1, 0, 1000)))


def test_best_schedule_chooses_recomputation_per_stage() -> None:
    prof = profile_with_policies()
    plain = dd.predict("1f1b", prof)
    full = dd.predict("1f1b", prof, remat="full")
    assert full.makespan > plain.makespan and full.peak_memory < plain.peak_memory
    assert plain.remat == {0: "none", 1: "none"} and full.remat == {0: "full", 1: "full"}
    # a limit the first stage of 1F1B (2 live microbatches) misses without recomputing
    # (by hand: worker 0 holds P + 2 live microbatches + its gradients and two sums =
    # 5 MB at B1; selective keeps half a microbatch: 4.5 MB at B1's accumulation)
    limit = 4_600_000
    assert plain.memory == (5_000_000, 4_000_000)
    ranked = dd.best_schedule(prof, memory_limit=limit, schedules=["1f1b"])
    _, _, pred = ranked[0]
    assert pred.peak_memory <= limit
    assert pred.remat == {0: "selective", 1: "none"}      # the first stage, and cheaply
    assert pred.makespan < full.makespan
    # what it assumes is what predict gives for that policy, and what a step takes
    again = dd.predict("1f1b", prof, remat=pred.remat)
    assert again.memory == pred.memory and again.makespan == pytest.approx(pred.makespan)
    with pytest.raises(dd.ArgumentError, match=r"remat names stage\(s\) \[5\]"):
        dd.predict("1f1b", prof, remat={5: "full"})
    Options.make("t", remat=pred.remat)
    # no policy: the plain ranking refuses the limit; an impossible limit says why
    with pytest.raises(dd.ArgumentError, match="no schedule fits"):
        dd.best_schedule(prof, memory_limit=limit, schedules=["1f1b"], remat="none")
    with pytest.raises(dd.ArgumentError, match="even with full recomputation"):
        dd.best_schedule(prof, memory_limit=10, schedules=["1f1b"])


# ------------------------------------------------------------------ refused before it runs

def test_a_step_over_the_workers_memory_limit_is_refused_at_build() -> None:
    import dask

    # the limit is recorded but not enforced (no pause, spill or restart of a worker)
    with dask.config.set({"distributed.worker.memory.target": False,
                          "distributed.worker.memory.spill": False,
                          "distributed.worker.memory.pause": False,
                          "distributed.worker.memory.terminate": False}):
        cluster = dd.local_cluster(2, memory_limit="24MiB", dashboard_address=None,
                                   quiet=True)
        client = Client(cluster)
    try:
        loss = staged(2, 4)
        args = mlp(256, 8192, 4)          # GPipe, 8 microbatches of (1024, 256): ~50 MiB
        step = dd.value_and_grad(loss, microbatches=8, schedule="gpipe")
        with pytest.raises(dd.MemoryLimitError) as e:
            step(*args)
        text = str(e.value)
        assert "stage 0" in text and "MiB" in text and "memory_limit of 24.00 MiB" in text
        assert any(w in text for w in client.scheduler_info()["workers"])
        assert "remat=" in text
        # the Trainer's step checks the same, with its optimizer state
        trainer = dd.Trainer(loss, optax.sgd(0.1), microbatches=8, schedule="gpipe",
                             client=client)
        with pytest.raises(dd.MemoryLimitError, match="stage 0"):
            trainer.step(trainer.init(args[0]), *args[1:])
        # recomputing everything fits: the step runs and its gradients are JAX's
        got_l, got_g = dd.value_and_grad(loss, microbatches=8, schedule="gpipe",
                                         remat="full").compute(*args)
        M.assert_matches_jax(loss, args, got_l, got_g)
        # a Trainer's optimizer state counts: one 1024-wide layer per stage (4 MiB) needs
        # ~17 MiB with sgd (no state) and ~25 MiB with adam's two moments (8 MiB more)
        big = staged(2, 2)
        wide = mlp(1024, 64, 2)
        sgd = dd.Trainer(big, optax.sgd(0.1), microbatches=8, schedule="gpipe",
                         client=client)
        _, loss_sgd = sgd.step(sgd.init(wide[0]), *wide[1:])
        np.testing.assert_allclose(loss_sgd.result(), big(*wide), rtol=1e-5)
        adam = dd.Trainer(big, optax.adam(0.1), microbatches=8, schedule="gpipe",
                          client=client)
        with pytest.raises(dd.MemoryLimitError, match=r"8\.0\d MiB optimizer state"):
            adam.step(adam.init(wide[0]), *wide[1:])
    finally:
        client.close()
        cluster.close()


@pytest.mark.distributed
def test_the_limit_check_counts_the_workers_own_memory_where_dask_enforces_it(
        client2: Any, monkeypatch: Any) -> None:
    """With Dask's defaults a worker pauses at 80% of its memory_limit and is restarted
    at 95%: a step whose own bytes fit the limit but not beside what the process already
    holds (the JAX runtime: ~200 MiB here) is refused at build (the nanny killed it)."""
    import dask

    from dagdiff.cluster import info as cluster_info
    from dagdiff.lowering import memory as lowering_memory
    from dagdiff.runtime.plugins import MEMORY_METRIC

    loss = staged(2, 4)
    args = mlp(256, 2048, 4)          # GPipe, 8 microbatches: ~13 MiB on worker 0
    step = dd.value_and_grad(loss, microbatches=8, schedule="gpipe")
    with client2.as_current():
        step(*args)                           # dagdiff's worker plugin is installed
    mib = 2 ** 20
    # what the workers tell in their heartbeats: Dask's defaults (pause, restart)
    deadline = time.monotonic() + 30
    while True:
        real = cluster_info.workers_info(client2)
        told = {a: (w.get("metrics") or {}).get(MEMORY_METRIC) for a, w in real.items()}
        if all(told.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert told and all(list(t) == [0.8, 0.95] for t in told.values()), told
    enforced = [0.8, 0.95]

    def info(client: Any, cached: bool = False) -> dict[str, Any]:
        return {a: {**w, "memory_limit": 64 * mib,
                    "metrics": {**w.get("metrics", {}), "memory": 45 * mib + 8 * mib,
                                "managed_bytes": 8 * mib, MEMORY_METRIC: enforced}}
                for a, w in real.items()}

    monkeypatch.setattr(lowering_memory, "workers_info", info)
    # each step lowered (the check runs when a step is lowered, not when a template binds)
    monkeypatch.setitem(dask.config.config.setdefault("dagdiff", {}), "step-templates", False)
    with client2.as_current():
        with pytest.raises(dd.MemoryLimitError,
                           match=r"leaves beside the 45.00 MiB.*pauses it at 80%"):
            step(*args)                       # 45 + 13 MiB > 80% of 64 MiB
        enforced[:] = [0.0, 0.95]             # no pause: restarted at 95%
        step(*args)                           # 45 + 13 MiB < 95% of 64 MiB
        enforced[:] = [0.0, 0.0]              # not enforced: 13 MiB < 64 MiB
        step(*args)


def test_a_new_placement_moves_resident_parameters_without_a_stale_copy(client2: Any
                                                                         ) -> None:
    """The same parameters under 2 stages, then 4 (two per worker): each is scattered to
    its stage's new worker, and the copy on the old one goes (it was kept, and fetched
    from there every step)."""
    import gc
    import time

    def scattered() -> dict[str, int]:
        return {w: sum(str(k).startswith("ArrayImpl-") for k in keys)
                for w, keys in client2.has_what().items()}

    gc.collect()                      # parameters of earlier tests on this cluster go
    before, deadline = scattered(), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = scattered()
        if now == before:
            break
        before = now
    params, x, t = mlp(16, 16, 8)

    with client2.as_current():
        for n, sched in ((2, get_schedule("1f1b")),
                         (4, get_schedule("interleaved", virtual_stages=2))):
            loss = staged(n, 8)
            got_l, got_g = dd.value_and_grad(loss, microbatches=4, schedule=sched).compute(
                params, x, t)
            M.assert_matches_jax(loss, (params, x, t), got_l, got_g)
            def added() -> list[int]:
                now = scattered()
                return sorted(now[w] - before.get(w, 0) for w in now)

            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and added() != [8, 8]:
                time.sleep(0.05)       # the old copies go when the scheduler frees them
            # 8 layers x (w, b) = 16 arrays: 8 on each worker, wherever the stages are
            assert added() == [8, 8], (n, scattered(), before)


def test_worker_memory_samples_are_put_in_the_schedulers_clock() -> None:
    """A worker's memory samples are shifted by its clock-offset estimate, as its tasks'
    and actions' times are: with an offset of a few ms (as on one machine) a small step's
    samples otherwise fell outside its own actions' span (`step_peaks` lost a worker)."""
    import time as time_mod

    from dagdiff.inspect.capture import _stop_sampling
    from dagdiff.runtime import memory

    class Worker:
        scheduler_delay = 5.0

    memory.start()
    t = time_mod.time()
    shifted = _stop_sampling(Worker())
    assert shifted and all(abs(s.time - (t + 5.0)) < 1.0 for s in shifted)
    memory.start()
    plain = _stop_sampling(None)
    assert plain and all(abs(s.time - t) < 1.0 for s in plain)
