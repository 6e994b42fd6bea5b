"""Compile once, run many: a direct-dispatch step with the structure of an earlier one binds
that step's lowered graph (keys, batch, parameters) instead of being lowered again, and
gives what a fresh build gives."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.lowering import template as templates
from tests.models import optax_reference
from tests.models import close, data, make_loss

pytestmark = pytest.mark.distributed


def _graph(out: Any) -> tuple[dict[str, Any], Any]:
    (layer,) = out.__dask_graph__().layers.values()
    return dict(layer), layer.annotations


def _steps(client: Any, step: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    """Submit every step before reading any (steps in flight together)."""
    futures = [client.compute(list(step(*a))) for a in args]
    return [client.gather(f) for f in futures]


def test_a_bound_step_is_the_step_a_fresh_build_gives(client2: Any) -> None:
    """Same keys, same tasks and placement, priorities on a later base; its result equals
    jax.value_and_grad; a lowered step leaves a template the next one binds."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    step = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")
    templates.clear()
    with client2.as_current():
        with dask.config.set({"dagdiff.step-templates": False}):
            fresh_l, _ = step(params, x, t)
        x2 = x * 2.0
        first, _ = step(params, x2 + 1.0, t)              # lowered: the template
        bound_l, bound_g = step(params, x, t)             # bound to x
        assert templates.stats()["lowered"] == 1 and templates.stats()["bound"] == 1
        fresh, fa = _graph(fresh_l)
        bound, ba = _graph(bound_l)
        assert sorted(fresh) == sorted(bound) and bound_l.key == fresh_l.key
        for k in fresh:
            assert type(fresh[k]) is type(bound[k]), k
            assert ba["resources"](k) == fa["resources"](k), k
            assert set(getattr(fresh[k], "dependencies", ())) == set(
                getattr(bound[k], "dependencies", ())), k
        progs = [k for k in fresh if k.startswith("prog_")]
        assert progs and all(ba["priority"](k) < fa["priority"](k) for k in progs)
        got_l, got_g = client2.compute([bound_l, bound_g], sync=True)
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


def test_a_training_loop_binds_one_template_and_matches_jax(client2: Any) -> None:
    """A notebook's loop: new batch values and new parameter arrays every step (updated on
    the client), two steps in flight, the same step again: one lowering, every result
    equal to jax.value_and_grad."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    step = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")
    templates.clear()
    with client2.as_current():
        for i in range(4):
            xs = [x * (1 + i + j) for j in range(2)]
            got = _steps(client2, step, [(params, xb, t) for xb in xs])
            for xb, (gl, gg) in zip(xs, got):
                want_l, want_g = jax.value_and_grad(loss_fn)(params, xb, t)
                np.testing.assert_allclose(gl, want_l, rtol=1e-5)
                close(gg, want_g)
            params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, got[0][1])
        again = step(params, x, t)
        first = client2.compute(list(again), sync=True)
        second = client2.compute(list(again), sync=True)
        np.testing.assert_allclose(first[0], second[0], rtol=0)
    stats = templates.stats()
    assert stats["lowered"] == 1 and stats["bound"] == 4 * 2


def test_what_the_lowering_depends_on_gives_another_template(client2: Any) -> None:
    """Another batch shape, another schedule, a config setting lowering reads: each is
    lowered anew (and is right); back to the first binds the first template."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    templates.clear()
    with client2.as_current():
        runs = [
            ({}, (params, x, t), "1f1b"),
            ({}, (params, x[:8], t[:8]), "1f1b"),
            ({}, (params, x, t), "gpipe"),
            ({"dagdiff.fuse-loss-backward": False}, (params, x, t), "1f1b"),
            ({}, (params, x * 3, t), "1f1b"),
        ]
        for cfg, args, schedule in runs:
            with dask.config.set(cfg):
                step = dd.value_and_grad(loss_fn, microbatches=4, schedule=schedule)
                got_l, got_g = client2.compute(list(step(*args)), sync=True)
            want_l, want_g = jax.value_and_grad(loss_fn)(*args)
            np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
            close(got_g, want_g)
    stats = templates.stats()
    assert stats["lowered"] == 4 and stats["bound"] == 1


def _announce(dask_scheduler: Any = None) -> None:
    dask_scheduler.plugins["dagdiff-colocate-vjp"]._announce("add", "tcp://127.0.0.1:1")


def test_the_worker_list_is_asked_once_until_the_scheduler_announces_a_change(
        client2: Any, monkeypatch: Any) -> None:
    """Building a step asks the scheduler for its workers once, then reads the client's
    cached list until dagdiff's scheduler plugin announces a worker joining or leaving."""
    import time

    from dagdiff.cluster import info
    from dagdiff.runtime.plugins import ensure_colocation

    assert ensure_colocation(client2)
    info.forget_workers(client2)
    info.workers_info(client2, cached=True)
    asked = []
    real = client2.scheduler.identity

    def identity(*a: Any, **k: Any) -> Any:
        if k.get("n_workers") != 0:     # not the client's own periodic refresh (no workers)
            asked.append(1)
        return real(*a, **k)

    monkeypatch.setattr(client2.scheduler, "identity", identity)
    for _ in range(3):
        assert len(info.workers_info(client2, cached=True)) == 2
    assert asked == []
    assert len(info.workers_info(client2)) == 2 and asked == [1]      # not cached: asks
    client2.run_on_scheduler(_announce)
    deadline = time.monotonic() + 10
    while client2 in info._CACHE and time.monotonic() < deadline:
        time.sleep(0.02)
    info.workers_info(client2, cached=True)
    assert asked == [1, 1]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_trainer_lowers_its_step_once_and_trains_like_optax(client4: Any,
                                                              replicas: int) -> None:
    """`Trainer.fit` (two steps in flight) and `step`: the first step is lowered, every
    later one binds its template (new batch, the previous step's state); losses and
    parameters equal plain JAX + optax (adam)."""
    import optax

    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    batches = [(x * (1 + i / 3), t) for i in range(5)]
    opt = optax.adam(1e-2)
    templates.clear()
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", replicas=replicas,
                         client=client4)
    state, losses = trainer.fit(batches[:4], params=params, progress=False)
    state, loss = trainer.step(state, *batches[4])
    losses.append(float(loss.result()))
    p, want = optax_reference(loss_fn, opt, params, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    close(trainer.params(state), p)
    stats = templates.stats()
    assert stats["lowered"] == 1 and stats["bound"] == 4, stats


def test_abstract_inputs_of_other_shapes_or_dtypes_give_other_trace_tokens() -> None:
    """A traced step's abstract parameters (`jax.ShapeDtypeStruct`, as the Trainer traces)
    enter its token by shape, dtype and weak type: every combination below gives its own
    token (bfloat16 and the float8 types share NumPy's dtype code), the same one again
    gives the same token."""
    import ml_dtypes

    from dagdiff.core.trace_fn import trace_call
    from dagdiff.lowering.lower import trace_token

    @dd.layer
    def scale(p: Any, x: Any) -> Any:
        return x * p.astype(x.dtype)

    def fn(p: Any, x: Any) -> Any:
        return scale(p, x)

    def token(p: Any) -> str:
        trace, _, _ = trace_call(fn, (p, np.ones(3, np.float32)), {}, (0,), "fn")
        return trace_token(trace)

    kinds = [((3,), np.float32, False), ((3,), np.float32, True), ((1,), np.float32, False),
             ((3,), np.float16, False), ((3,), jax.numpy.bfloat16, False),
             ((3,), ml_dtypes.float8_e4m3fn, False), ((3,), ml_dtypes.float8_e5m2, False)]
    tokens = [token(jax.ShapeDtypeStruct(s, d, weak_type=w)) for s, d, w in kinds]
    assert len(set(tokens)) == len(kinds)
    assert token(jax.ShapeDtypeStruct((3,), jax.numpy.bfloat16)) == tokens[4]


def test_a_closed_traces_digest_is_kept_and_its_token_still_tells_extras_and_bindings(
        monkeypatch: Any) -> None:
    """A Trainer tokenizes its one trace every step: the structure and input values of a
    closed trace are hashed once per binding, and the token still changes with the extra
    parts, the bound inputs, and from one trace to another of other values."""
    from dagdiff.core.trace_fn import trace_call
    from dagdiff.lowering import lower as lower_mod

    @dd.layer
    def scale(p: Any, x: Any) -> Any:
        return x * p

    def fn(p: Any, x: Any) -> Any:
        return scale(p, x)

    calls = []
    real = lower_mod._structure_digest
    monkeypatch.setattr(lower_mod, "_structure_digest",
                        lambda *a: calls.append(1) or real(*a))
    trace, _, _ = trace_call(fn, (np.float32(2.0), np.ones(3, np.float32)), {}, (0,), "fn")
    assert trace.closed
    first = lower_mod.trace_token(trace, ("opts", 1))
    assert lower_mod.trace_token(trace, ("opts", 1)) == first
    assert lower_mod.trace_token(trace, ("opts", 2)) != first
    assert len(calls) == 1                                   # hashed once for both extras
    x_node = [n.index for n in trace.nodes if n.kind != "call"][-1]
    bound = lower_mod.trace_token(trace, ("opts", 1), bound={x_node: 0})
    assert bound != first and len(calls) == 2
    assert lower_mod.trace_token(trace, ("opts", 1), bound={x_node: 0}) == bound
    assert lower_mod.trace_token(trace, ("opts", 1), bound={x_node: 1}) != bound
    other, _, _ = trace_call(fn, (np.float32(2.0), np.full(3, 2.0, np.float32)), {}, (0,),
                             "fn")
    assert lower_mod.trace_token(other, ("opts", 1)) != first    # other input values
    again, _, _ = trace_call(fn, (np.float32(2.0), np.ones(3, np.float32)), {}, (0,), "fn")
    assert lower_mod.trace_token(again, ("opts", 1)) == first    # the same, traced again


def _body_stats() -> dict[str, int]:
    from dagdiff.runtime.direct.program import body_cache_stats

    return body_cache_stats()


def test_a_templates_programs_pickle_their_body_once_per_process() -> None:
    """A template's program pickles as its key, step and body id + bytes made once; a
    process that has the body reuses it (the same actions object); another program
    pickles whole and is not cached; the caches stay within their bound."""
    import pickle

    from dagdiff.runtime.direct import program as pm
    from dagdiff.runtime.direct.plan import PlannedAction
    from dagdiff.runtime.taskspec import Task

    actions = tuple(PlannedAction(f"a{i}", (), 0, (), False, Task(f"a{i}", sum, [i, i]))
                    for i in range(3))
    shared = pm.Program("prog-1", "s1", "slot0", "tcp://w:1", actions, ("x",), 5.0,
                        shared=True)
    blob1 = pickle.dumps(shared)
    blob2 = pickle.dumps(pm.dataclasses.replace(shared, key="prog-2", step="s2"))
    # the body's bytes are made once: both pickles carry the same id and bytes
    assert pickle.loads(blob1) == shared
    assert _body_stats()["hits"] >= 1
    again = pickle.loads(blob2)
    assert again.key == "prog-2" and again.step == "s2" and again.shared
    assert again.actions == actions
    # the receiving side's cache hands out one body: the same actions object
    assert pickle.loads(blob1).actions is again.actions
    plain = pm.dataclasses.replace(shared, shared=False, key="prog-3")
    before = _body_stats()
    back = pickle.loads(pickle.dumps(plain))
    assert back == plain and not back.shared
    assert _body_stats()["bodies"] == before["bodies"]
    old = pm.BODY_CACHE_ENTRIES
    try:
        pm.BODY_CACHE_ENTRIES = 2
        for i in range(5):
            acts = (PlannedAction(f"b{i}", (), 0, (), False, Task(f"b{i}", sum, [i])),)
            pickle.loads(pickle.dumps(pm.Program(f"p{i}", "s", "slot0", "w", acts, (), 1.0,
                                                 shared=True)))
        assert _body_stats()["bodies"] <= 2
    finally:
        pm.BODY_CACHE_ENTRIES = old


def test_bound_steps_send_their_programs_bodies_once(client2: Any) -> None:
    """Steps bound from one template reuse the workers' copy of each program's body
    (each worker unpickles it once), and still give jax.value_and_grad's values."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    step = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")
    for warm in (x, x * 2.0):               # lowered (the template), then bound once
        step.compute(params, warm, t, client=client2)
    before = client2.run(_body_stats)
    for i in range(4):
        xi = x + float(i)
        got = step.compute(params, xi, t, client=client2)
        want_l, want_g = jax.value_and_grad(loss_fn)(params, xi, t)
        np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
        close(got[1], want_g)
    after = client2.run(_body_stats)
    for w in after:
        assert after[w]["misses"] == before[w]["misses"], (w, before[w], after[w])
        assert after[w]["hits"] >= before[w]["hits"] + 4, (w, before[w], after[w])


def test_bound_steps_carry_objects_of_main_by_value(client2: Any, monkeypatch: Any) -> None:
    """A step whose layer reads a static object of a class defined in `__main__` (a
    notebook's): the bound steps' program bodies carry it by value (the workers have no
    such `__main__` attribute), and each step gives jax.value_and_grad's values."""
    import dataclasses
    import sys

    @dataclasses.dataclass(frozen=True)
    class Scale:
        factor: float

    Scale.__module__, Scale.__qualname__ = "__main__", "Scale"
    monkeypatch.setattr(sys.modules["__main__"], "Scale", Scale, raising=False)

    @dd.layer
    def scaled(w: Any, x: Any, how: Any) -> Any:
        return jnp.tanh(x @ w) * how.factor

    @dd.layer
    def mse(y: Any, t: Any) -> Any:
        return jnp.mean((y - t) ** 2)

    def loss_fn(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = scaled(params[0], x, Scale(0.5))
        with dd.stage(1):
            return mse(scaled(params[1], h, Scale(2.0)), t)

    def plain(params: Any, x: Any, t: Any) -> Any:
        h = jnp.tanh(x @ params[0]) * 0.5
        return jnp.mean((jnp.tanh(h @ params[1]) * 2.0 - t) ** 2)

    key = jax.random.PRNGKey(3)
    params = [jax.random.normal(jax.random.fold_in(key, i), (8, 8)) / 3 for i in range(2)]
    t = jnp.ones((8, 8))
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    for i in range(3):                      # lowered, then bound twice
        x = jax.random.normal(jax.random.fold_in(key, 10 + i), (8, 8))
        got_l, got_g = step.compute(params, x, t, client=client2)
        want_l, want_g = jax.value_and_grad(plain)(params, x, t)
        np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
        close(got_g, want_g)
