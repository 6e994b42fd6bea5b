"""Stages pinned to worker slots / local devices, resident params, restarts, auto stages, fusion."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.cluster.info import slot_names
from tests import models as M
from tests.models import close

KEY = jax.random.PRNGKey(3)


@dd.layer(stage=0)
def embed(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


def staged_loss(params: Any, x: Any, t: Any) -> Any:
    h = embed(params[0], x)                     # stage 0 via the layer
    h = M.dense(params[1], h)                   # no stage: stage of the enclosing block (None)
    for s in (1, 2, 3):
        with dd.stage(s):                       # context-manager form
            h = M.dense(params[2 * s], h)
            h = M.dense(params[2 * s + 1], h)
    with dd.stage(3):
        return M.mse(h, t)


def staged_loss_all(params: Any, x: Any, t: Any) -> Any:
    with dd.stage(0):
        return staged_loss(params, x, t)


def data(width: int = 16, batch: int = 8) -> tuple[Any, Any, Any]:
    params = M.init_dense(KEY, [width] * 9)
    x = jax.random.normal(jax.random.fold_in(KEY, 1), (batch, width))
    t = jax.random.normal(jax.random.fold_in(KEY, 2), (batch, width))
    return params, x, t


def run_recorded(client: Any, fn: Any, *args: Any,
                 **kw: Any) -> tuple[Any, Any, dict[str, str], Any]:
    from distributed import get_task_stream

    with client.as_current():
        loss, grads = dd.value_and_grad(fn, **kw)(*args)
        with get_task_stream(client) as ts:
            got = client.compute([loss, grads], sync=True)
    where = {r["key"]: r["worker"] for r in ts.data if isinstance(r["key"], str)}
    return got, loss, where, grads


def _dagdiff(where: dict[str, str]) -> dict[str, str]:
    out = {}
    for k, w in where.items():
        try:
            dd.key_info(k)
        except ValueError:
            continue
        out[k] = w
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("nworkers", [2, 4])
def test_stages_run_on_their_slots(request: Any, nworkers: int) -> None:
    client = request.getfixturevalue(f"client{nworkers}")
    params, x, t = data()
    dd.reset_remat_count(client)
    got, loss, where, grads = run_recorded(client, staged_loss_all, params, x, t)
    want = jax.value_and_grad(staged_loss_all)(params, x, t)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    close(got[1], want[1])

    slot_of = slot_names(client)
    where = _dagdiff(where)
    assert {dd.key_info(k).phase for k in where} >= {"F", "B"}
    for k, w in where.items():
        info = dd.key_info(k)
        if info.phase in ("F", "B") and info.stage is not None:
            assert slot_of[w] == f"slot{info.stage % nworkers}", (k, slot_of[w])
        if info.phase == "B":
            assert where["fwd" + k[3:]] == w               # VJP where its pullback is
    # activations cross workers only at stage boundaries
    g = loss.__dask_graph__()
    for k, task in g.items():
        if k not in where:
            continue
        for dep in task.dependencies:
            if dep in where and where[dep] != where[k]:
                assert dd.key_info(dep).stage != dd.key_info(k).stage, (dep, k)
    assert dd.remat_count(client) == 0


@pytest.mark.distributed
def test_params_stay_on_workers_between_calls(client2: Any) -> None:
    params, x, t = data()

    def external_deps(loss: Any) -> set[str]:
        g = loss.__dask_graph__()
        return {d for task in g.values() for d in task.dependencies if d not in g}

    with client2.as_current():
        loss1, grads1 = dd.value_and_grad(staged_loss_all)(params, x, t)
        client2.compute([loss1, grads1], sync=True)
        loss2, grads2 = dd.value_and_grad(staged_loss_all)(params, x + 1.0, t)
        got = client2.compute([loss2, grads2], sync=True)
    g2 = loss2.__dask_graph__()
    # no parameter data travels with the second graph: params are Futures already on workers
    assert not [k for k in g2 if dd.key_info(k).phase == "param"]
    assert external_deps(loss1) == external_deps(loss2)
    assert len(external_deps(loss2)) == len(jax.tree_util.tree_leaves(params))
    nbytes = client2.run_on_scheduler(
        lambda dask_scheduler, keys=sorted(external_deps(loss2)): sum(
            dask_scheduler.tasks[k].nbytes for k in keys))
    assert nbytes >= sum(a.nbytes for a in jax.tree_util.tree_leaves(params))  # true sizes
    close(got[1], jax.grad(staged_loss_all)(params, x + 1.0, t))


@pytest.mark.distributed
@pytest.mark.slow
def test_restart_keeps_stage_pinning(client2: Any) -> None:
    params, x, t = data()
    run_recorded(client2, staged_loss_all, params, x, t)
    client2.restart_workers(list(client2.scheduler_info()["workers"]))
    got, loss, where, _ = run_recorded(client2, staged_loss_all, params, x, t)
    close(got[1], jax.grad(staged_loss_all)(params, x, t))
    slot_of = slot_names(client2)
    for k, w in _dagdiff(where).items():
        info = dd.key_info(k)
        if info.phase == "F" and info.stage is not None:
            assert slot_of[w] == f"slot{info.stage % 2}"


@pytest.mark.distributed
def test_placement_override_and_errors(client2: Any) -> None:
    params, x, t = data()
    got, loss, where, _ = run_recorded(client2, staged_loss_all, params, x, t,
                                       placement={0: 1, 1: 1, 2: 0, 3: 0})
    slot_of = slot_names(client2)
    for k, w in _dagdiff(where).items():
        info = dd.key_info(k)
        if info.phase == "F" and info.stage is not None:
            assert slot_of[w] == ("slot1" if info.stage < 2 else "slot0")
    with client2.as_current(), pytest.raises(dd.PlacementError, match="slot"):
        dd.value_and_grad(staged_loss_all, placement={0: 7})(params, x, t)


def test_single_process_device_pinning() -> None:
    devices = jax.local_devices()
    if len(devices) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax import")
    params, x, t = data()
    loss, grads = dd.value_and_grad(staged_loss_all)(params, x, t)
    g = dict(loss.__dask_graph__())
    fwd = [k for k in g if dd.key_info(k).phase == "F"]
    results = dask.get(g, fwd)
    for k, r in zip(fwd, results):
        assert r.out[0].devices() == {devices[dd.key_info(k).stage % len(devices)]}, k
    got = dask.compute(loss, grads, scheduler="threads")
    close(got[1], jax.grad(staged_loss_all)(params, x, t))


@dd.layer
def wide(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


def test_auto_stages_balance_by_cost() -> None:
    from dagdiff.core.auto import balanced_split, node_costs

    widths = [256, 8, 8, 8, 8, 8, 256, 8]        # layers of very unequal cost

    def loss_fn(ps: Any, x: Any) -> Any:
        h = x
        for p in ps:
            h = wide(p, h)
        return M.mse(h, x)

    ps = [{"w1": jnp.ones((16, w)) * 0.01, "w2": jnp.ones((w, 16)) * 0.01} for w in widths]
    x = jnp.ones((64, 16))
    from dagdiff.core.trace_fn import trace_call

    trace, _, _ = trace_call(loss_fn, (ps, x), {}, (0,), "loss_fn")
    costs = node_costs(trace)
    assert costs[0] > 10 * costs[1]               # the estimate sees the difference
    k = 3
    auto = balanced_split(costs, k)
    equal = [min(i * k // len(costs), k - 1) for i in range(len(costs))]
    assert auto == sorted(auto) and set(auto) == set(range(k))

    def max_stage(assign: list[int]) -> float:
        return max(sum(c for c, s in zip(costs, assign) if s == j) for j in range(k))

    assert max_stage(auto) < max_stage(equal)
    loss, grads = dd.value_and_grad(loss_fn, stages=k)(ps, x)
    stages = {dd.key_info(key).stage for key in loss.__dask_graph__()
              if dd.key_info(key).phase == "F"}
    assert stages == set(range(k))
    got = dask.compute(grads, scheduler="threads")[0]
    close(got, jax.grad(loss_fn)(ps, x))


def test_fusion_one_task_pair_per_stage(compute: Any) -> None:
    params, x, t = data()
    loss, grads = dd.value_and_grad(staged_loss_all, fuse=True)(params, x, t)
    g = loss.__dask_graph__()
    fwd = sorted({dask.utils.key_split(k) for k in g if dd.key_info(k).phase == "F"})
    assert fwd == ["fwd_s0_embed_dense", "fwd_s1_dense_x2", "fwd_s2_dense_x2",
                   "fwd_s3_dense_x2_mse"]
    assert sum(dd.key_info(k).phase == "B" for k in g) == 4
    got = compute(loss, grads)
    want = jax.value_and_grad(staged_loss_all)(params, x, t)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    close(got[1], want[1])


def test_a_stage_whose_slot_is_lost_goes_to_a_free_survivor_else_the_least_busy() -> None:
    """The fallback of `resolve_targets` for slots with no worker now (literal cases)."""
    from dagdiff.cluster.targets import _on_survivors

    names = ["slot0", "slot1", "slot2", "slot3"]
    live = {n: f"tcp://w{n[-1]}" for n in names if n != "slot1"}
    of, addresses, moved = _on_survivors({0: "slot0", 1: "slot1"}, names, live)
    assert of == {0: "slot0", 1: "slot2"} and moved == {1: ("slot1", "slot2")}
    assert addresses == live
    # every slot busy: the next one after the lost slot among the least busy
    of, _, moved = _on_survivors({0: "slot0", 1: "slot1", 2: "slot2", 3: "slot3"}, names,
                                 live)
    assert of[1] == "slot2" and moved == {1: ("slot1", "slot2")}
    # two stages lost: spread over the least busy, in slot order after each
    live2 = {"slot0": "a", "slot3": "d"}
    of, _, moved = _on_survivors({0: "slot0", 1: "slot1", 2: "slot2", 3: "slot3"}, names,
                                 live2)
    assert of == {0: "slot0", 1: "slot3", 2: "slot0", 3: "slot3"}
    with pytest.raises(dd.PlacementError, match="no worker"):
        _on_survivors({0: "slot0"}, names, {})
