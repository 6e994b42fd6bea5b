"""Graph structure, keys, trace-time errors, rematerialization, colocation, compile caching."""
from __future__ import annotations

import pickle
import types
from typing import Any

import cloudpickle
import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dask.utils import key_split

import dagdiff as dd
from tests import models as M

KEY = jax.random.PRNGKey(0)


def setup(sizes: list[int] = [4, 8, 8, 3], n: int = 6) -> tuple[Any, Any, Any]:
    params = M.init_dense(KEY, sizes)
    x = jax.random.normal(jax.random.fold_in(KEY, 1), (n, sizes[0]))
    t = jax.random.normal(jax.random.fold_in(KEY, 2), (n, sizes[-1]))
    return params, x, t


def keys_of(d: Any) -> list[str]:
    return list(d.__dask_graph__().keys())


def test_key_prefixes_name_phase_and_layer() -> None:
    loss, grads = dd.value_and_grad(M.mlp_loss)(*setup())
    prefixes = {key_split(k) for k in keys_of(loss)}
    assert {"fwd_dense", "vjp_dense", "fwd_mse", "vjp_mse", "loss_mse"} <= prefixes
    assert "grad_params_0_w" in prefixes and "param_params_0_w" in prefixes
    infos = [dd.key_info(k) for k in keys_of(loss)]
    assert {i.phase for i in infos} >= {"F", "B", "grad", "param", "input", "loss"}
    f = next(i for i in infos if i.phase == "F" and i.layer == "dense")
    assert f == dd.KeyInfo("F", "dense", None, None)


def test_key_info_round_trip_and_errors() -> None:
    from dagdiff.core.keys import make_key

    k = make_key("W", "block_2", 7, "abc123", stage=3, microbatch=5)
    assert key_split(k) == "wgrad_block_2"
    assert dd.key_info(k) == ("W", "block_2", 3, 5)
    assert dd.key_info(("fwd_enc-n1-ff", 0)).phase == "F"
    with pytest.raises(dd.KeyFormatError):
        dd.key_info("getitem-123abc")
    with pytest.raises(ValueError):
        dd.key_info("fwd-dense")


def test_keys_are_deterministic_and_depend_on_data() -> None:
    params, x, t = setup()
    a = sorted(keys_of(dd.value_and_grad(M.mlp_loss)(params, x, t)[0]))
    b = sorted(keys_of(dd.value_and_grad(M.mlp_loss)(params, x, t)[0]))
    c = sorted(keys_of(dd.value_and_grad(M.mlp_loss)(params, x + 1.0, t)[0]))
    assert a == b
    assert not set(a) & set(c)


def test_graph_size_is_two_tasks_per_layer_call_plus_bookkeeping() -> None:
    calls: list[str] = []

    def counted_loss(params: Any, x: Any, t: Any) -> Any:
        h = x
        for p in params:
            calls.append("dense")
            h = M.dense(p, h)
        calls.append("mse")
        return M.mse(h, t)

    params, x, t = setup([4, 8, 8, 8, 3])
    loss, grads = dd.value_and_grad(counted_loss)(params, x, t)
    phases = [dd.key_info(k).phase for k in keys_of(loss)]
    n_leaves = len(jax.tree_util.tree_leaves(params))
    assert phases.count("F") == len(calls) == 5
    assert phases.count("B") == len(calls)          # every call reaches the loss
    assert phases.count("param") == phases.count("grad") == n_leaves
    assert phases.count("input") == 2 and phases.count("loss") == 1
    assert phases.count("add") == 0                 # a chain has no fan-out
    assert len(phases) == 2 * len(calls) + 2 * n_leaves + 3


def test_fan_out_becomes_add_tasks() -> None:
    params, x, t = setup([4, 4, 4])

    def fn(p: Any, x: Any, t: Any) -> Any:
        h = M.dense(p[0], x)
        return M.mse(M.dense(p[1], h) + h, t)    # h used twice

    loss, grads = dd.value_and_grad(fn)(params, x, t)
    adds = [k for k in keys_of(loss) if dd.key_info(k).phase == "add"]
    assert len(adds) == 1 and key_split(adds[0]) == "add_dense"


def test_first_layer_computes_no_input_cotangent() -> None:
    params, x, t = setup([4, 5, 3])
    loss, grads = dd.value_and_grad(M.mlp_loss)(params, x, t)
    g = loss.__dask_graph__()
    vjps = [g[k] for k in g if dd.key_info(k).phase == "B" and dd.key_info(k).layer == "dense"]
    wrts = sorted(len(t.args[2]) for t in vjps)    # (spec, srcs, wrt, ...)
    assert wrts == [2, 3]          # first layer: w, b only; second: w, b and its input


def test_shape_error_at_trace_time_names_layer_and_shapes() -> None:
    params, x, t = setup()
    bad = [dict(p) for p in params]
    bad[1]["w"] = jnp.ones((7, 8))
    with pytest.raises(dd.LayerShapeError) as e:
        dd.value_and_grad(M.mlp_loss)(bad, x, t)
    msg = str(e.value)
    assert "dense" in msg and "f32[6,8]" in msg and "f32[7,8]" in msg
    assert isinstance(e.value, ValueError)


def test_dtype_error_is_a_type_error() -> None:
    @dd.layer
    def needs_int(x: Any) -> Any:
        return jnp.left_shift(x, 1)

    with pytest.raises(TypeError) as e:
        dd.value_and_grad(lambda x: jnp.sum(needs_int(x)))(jnp.ones(3))
    assert "needs_int" in str(e.value)


def test_using_traced_data_outside_layers_is_a_clear_error() -> None:
    params, x, t = setup()

    def branchy(p: Any, x: Any, t: Any) -> Any:
        h = M.dense(p[0], x)
        if h:                                  # needs data
            pass
        return M.mse(h, t)

    def jnp_outside(p: Any, x: Any, t: Any) -> Any:
        return M.mse(jnp.tanh(M.dense(p[0], x)), t)

    for fn in (branchy, jnp_outside):
        with pytest.raises(dd.TracerError, match="dd.layer"):
            dd.value_and_grad(fn)(params, x, t)


def test_leaked_traced_value_and_bad_loss() -> None:
    params, x, t = setup()
    leaked = []

    def leak(p: Any, x: Any, t: Any) -> Any:
        h = M.dense(p[0], x)
        leaked.append(h)
        return M.mse(M.dense(p[1], h)[:, :3], t)

    dd.value_and_grad(leak)(params, x, t)
    with pytest.raises(dd.TracerError, match="after its trace"):
        M.dense(params[1], leaked[0])
    with pytest.raises(TypeError, match="scalar"):
        dd.value_and_grad(lambda p, x: M.dense(p[0], x))(params, x)
    with pytest.raises(dd.TracerError):
        dd.value_and_grad(lambda p, x: 1.0)(params, x)


def test_traced_values_have_shapes_and_operators() -> None:
    params, x, t = setup()
    seen = {}

    def fn(p: Any, x: Any, t: Any) -> Any:
        h = M.dense(p[0], x)
        seen["h"] = (h.shape, h.dtype, h.ndim, len(h))
        y = (h * 2.0 - 1.0) / 3.0
        y = (-y) ** 2 + h.T.T
        return M.mse(M.dense(p[1], y)[:, :3] @ jnp.eye(3), t)

    loss, grads = dd.value_and_grad(fn)(params, x, t)
    assert seen["h"] == ((6, 8), jnp.float32, 2, 6)
    got = dask.compute(loss, grads, scheduler="sync")
    want = jax.value_and_grad(fn)(params, x, t)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pullback_pickles_as_outputs_and_vjp_rematerializes() -> None:
    """The forced-remat path without a cluster: a FwdResult that was pickled has no
    pullback; the VJP task rebuilds it from its primal inputs and counts one event."""
    params, x, t = setup([4, 3])
    loss, grads = dd.value_and_grad(M.mlp_loss)(params, x, t)
    g = dict(loss.__dask_graph__())
    dd.reset_remat_count()
    moved = 0
    for k in list(g):
        if dd.key_info(k).phase == "F":       # every forward result crosses a process boundary
            task = g[k]
            g[k] = dask._task_spec.Task(k, _through_pickle, task)
            moved += 1
    grad_keys = [d.key for d in jax.tree_util.tree_leaves(grads)]
    out = dask.get(g, [loss.key, *grad_keys])
    want_l, want_g = jax.value_and_grad(M.mlp_loss)(params, x, t)
    np.testing.assert_allclose(out[0], want_l, rtol=1e-6)
    for a, b in zip(out[1:], jax.tree_util.tree_leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert dd.remat_count() == moved == 2


def _through_pickle(value: Any) -> Any:
    return cloudpickle.loads(cloudpickle.dumps(value))


def test_fwd_result_pickles_without_pullback_and_sizeof_counts_residuals() -> None:
    from dask.sizeof import sizeof

    params, x, t = setup([64, 64])
    spec_loss, _ = dd.value_and_grad(M.mlp_loss)(params, jnp.ones((128, 64)), jnp.ones((128, 64)))
    g = spec_loss.__dask_graph__()
    fk = next(k for k in g if dd.key_info(k).phase == "F" and dd.key_info(k).layer == "dense")
    res = dask.get(dict(g), fk)
    assert res.pullback is not None
    out_bytes = 128 * 64 * 4
    assert sizeof(res) > 2 * out_bytes        # outputs + residuals (x, w, tanh output)
    back = pickle.loads(pickle.dumps(res))
    assert back.pullback is None and back.moved
    np.testing.assert_array_equal(back.out[0], res.out[0])
    assert sizeof(jnp.ones((1000, 1000), jnp.float32)) >= 4_000_000


def test_jax_array_wire_serialization() -> None:
    from distributed.protocol import deserialize, serialize

    x = jnp.arange(12.0).reshape(3, 4)
    header, frames = serialize(x, serializers=("dask",))
    assert header["serializer"] == "dask"
    y = deserialize(header, frames)
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(y, x)



@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_cross_the_wire_and_tokenize_by_content(impl: str) -> None:
    """`jax.random.key` arrays (no NumPy view of their own) travel as their key data and
    implementation, and two keys of the same data get the same dask token."""
    from dask.base import tokenize
    from distributed.protocol import deserialize, serialize

    keys = jax.random.split(jax.random.key(3, impl=impl), 4)
    header, frames = serialize(keys, serializers=("dask",))
    back = deserialize(header, frames)
    assert back.dtype == keys.dtype and back.shape == keys.shape
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(keys))
    np.testing.assert_array_equal(jax.random.normal(back[1], (3,)),
                                  jax.random.normal(keys[1], (3,)))
    same = jax.random.split(jax.random.key(3, impl=impl), 4)
    other = jax.random.split(jax.random.key(4, impl=impl), 4)
    assert tokenize(keys) == tokenize(same) != tokenize(other)
    assert tokenize(jax.random.key_data(keys)) != tokenize(keys)

@pytest.mark.distributed
def test_vjp_runs_where_its_forward_ran(client2: Any) -> None:
    from distributed import get_task_stream

    params = {"stem": M.init_dense(KEY, [6, 8])[0],
              "branches": [M.init_dense(jax.random.fold_in(KEY, i), [8, 8])[0] for i in range(3)],
              "head": M.init_dense(KEY, [24, 2])[0]}
    x = jax.random.normal(KEY, (10, 6))
    t = jax.random.normal(KEY, (10, 2))
    dd.reset_remat_count(client2)
    with client2.as_current():
        loss, grads = dd.value_and_grad(M.branch_loss)(params, x, t)
        with get_task_stream(client2) as ts:
            got = client2.compute([loss, grads], sync=True)
    where = {}
    for rec in ts.data:
        if isinstance(rec["key"], str) and not rec["key"].startswith(("dict-", "list-")):
            where[rec["key"]] = rec["worker"]
    fwd = {k: w for k, w in where.items() if dd.key_info(k).phase == "F"}
    for k, w in where.items():
        if dd.key_info(k).phase == "B":
            assert fwd["fwd" + k[3:]] == w, k
    assert dd.remat_count(client2) == 0
    np.testing.assert_allclose(got[0], jax.value_and_grad(M.branch_loss)(params, x, t)[0],
                               rtol=1e-5)


@pytest.mark.parametrize("schedule", [None, "1f1b", "zb-h1"])
def test_each_backward_task_names_its_forward(schedule: str | None) -> None:
    """The scheduler plugin pairs a backward task with its forward by what the task reads
    (`pullback_of`: its forward argument), not by parsing keys: every VJP (and split
    I/W) task names the forward of the same layer call and microbatch (by its key), and
    no other task names one."""
    from dagdiff.runtime.tasks import pullback_of

    params, x, t = setup()
    kw = {} if schedule is None else {"microbatches": 2, "schedule": schedule, "stages": 2}
    loss, grads = dd.value_and_grad(M.mlp_loss, **kw)(params, x, t)
    graph = dict(loss.__dask_graph__())
    named = {k: f for k, task in graph.items() if (f := pullback_of(task)) is not None}
    backward = [k for k in graph if dd.key_info(k).phase in ("B", "I", "W")]
    assert backward and sorted(named) == sorted(backward)
    for k, f in named.items():
        kb, kf = dd.key_info(k), dd.key_info(f)
        assert kf.phase == "F" and f in graph, (k, f)
        assert (kb.layer, kb.stage, kb.microbatch) == (kf.layer, kf.stage, kf.microbatch)


@pytest.mark.distributed
def test_forced_move_rematerializes_and_counts(client2: Any) -> None:
    """Forward tasks pinned to one worker and VJP tasks to the other (by annotation, on a
    graph with no colocation): every pullback moves, is rebuilt, and grads stay exact."""
    from dask.highlevelgraph import HighLevelGraph
    from dask.delayed import Delayed

    params, x, t = setup([4, 6, 3])
    loss, grads = dd.value_and_grad(M.mlp_loss)(params, x, t)
    g = dict(loss.__dask_graph__())
    a, b = sorted(client2.scheduler_info()["workers"])
    fwd = {k: v for k, v in g.items() if dd.key_info(k).phase in ("F", "param", "input")}
    rest = {k: v for k, v in g.items() if k not in fwd}
    hlg = HighLevelGraph(
        {"fwd": _Layer(fwd, {"workers": a}), "rest": _Layer(rest, {"workers": b})},
        {"fwd": set(), "rest": {"fwd"}})
    outs = [Delayed(loss.key, hlg, layer="rest")] + [
        Delayed(d.key, hlg, layer="rest") for d in jax.tree_util.tree_leaves(grads)]
    dd.reset_remat_count(client2)
    got = client2.compute(outs, sync=True)
    want_l, want_g = jax.value_and_grad(M.mlp_loss)(params, x, t)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    for u, v in zip(got[1:], jax.tree_util.tree_leaves(want_g)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    n_vjp = sum(dd.key_info(k).phase == "B" for k in g)
    assert dd.remat_count(client2) == n_vjp == 3


def _Layer(dsk: dict[str, Any], annotations: dict[str, Any]) -> Any:
    from dask.highlevelgraph import MaterializedLayer

    return MaterializedLayer(dsk, annotations=annotations)


@pytest.mark.distributed
def test_by_value_layers_compile_once_per_worker(client2: Any) -> None:
    """A layer defined in a notebook/__main__ is pickled by value: a new function object per
    task. The worker-side cache compiles it once per worker and signature anyway."""
    mod = types.ModuleType("notebook_cell")
    exec(
        "import jax.numpy as jnp\nimport dagdiff as dd\n"
        "@dd.layer\ndef cell_dense(p, x):\n    return jnp.tanh(x @ p['w'] + p['b'])\n"
        "@dd.layer\ndef cell_mse(y, t):\n    return jnp.mean((y - t) ** 2)\n"
        "def loss(ps, x, t):\n    h = x\n    for p in ps:\n        h = cell_dense(p, h)\n"
        "    return cell_mse(h, t)\n", mod.__dict__)
    params, x, t = setup([5, 5, 5, 5, 5])      # 4 dense calls + 1 mse call per step
    before = dd.inspect.metrics.compile_counts(client2)
    sigs: set[str] = set()
    for i in range(4):
        loss, grads = dd.value_and_grad(mod.loss)(params, x + i, t)
        g = loss.__dask_graph__()
        sigs |= {g[k].args[0].fingerprint for k in g if dd.key_info(k).phase == "F"}
        client2.compute([loss, grads], sync=True)
    after = dd.inspect.metrics.compile_counts(client2)
    new = sum(after[w] - before.get(w, 0) for w in after if w != "local")
    # signatures: first dense (input not differentiated), other dense, mse
    assert len(sigs) == 3
    assert 1 <= new <= len(sigs) * 2, after    # at most once per worker and signature
    assert 4 * 5 > len(sigs) * 2               # ... far fewer than one compile per task


@pytest.mark.parametrize("setting,values", [
    ("dagdiff.fuse-loss-backward", (True, False)),
    ("dagdiff.dashboard.live-actions", (True, False)),
    ("dagdiff.direct.timeout", ("600s", "30s")),
])
def test_a_lowering_setting_is_part_of_every_key(setting: str, values: Any) -> None:
    """Two builds that differ only in Dask config that lowering reads get different keys
    (the scheduler would otherwise keep the first build's tasks under them)."""
    from dagdiff.build import LOWERING_SETTINGS

    assert setting in LOWERING_SETTINGS
    params, x, t = setup([4, 8, 3], n=8)

    def loss_fn(p: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = M.dense(p[0], x)
        with dd.stage(1):
            return M.mse(M.dense(p[1], h), t)

    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    keys = []
    for v in (values[0], values[0], values[1]):
        with dask.config.set({setting: v}):
            keys.append(step(params, x, t)[0].key)
    assert keys[0] == keys[1] != keys[2]


@pytest.mark.parametrize("how", ["dataclass", "flax", "methods"])
def test_pytree_classes_of_a_notebook_travel_to_the_workers(client2: Any, how: str) -> None:
    """Pytree classes defined where cloudpickle sends them by value (a notebook's or a
    script's ``__main__``; here a function's locals) lost their JAX registration on the
    workers: a layer taking one as its input, as its differentiated argument, or handing
    one from stage 0 to stage 1 failed there ("DynamicJaxprTracer has no attribute h",
    "not a valid JAX type"). Equal to `jax.value_and_grad` now, on the cluster."""
    import dataclasses

    import dask

    if how == "dataclass":
        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Carry:
            h: Any
            scale: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    elif how == "flax":
        flax_struct = pytest.importorskip("flax.struct")

        @flax_struct.dataclass
        class Carry:                                       # type: ignore[no-redef]
            h: Any
            scale: float = flax_struct.field(pytree_node=False, default=2.0)
    else:
        @jax.tree_util.register_pytree_node_class
        class Carry:                                       # type: ignore[no-redef]
            def __init__(self, h: Any, scale: float = 2.0) -> None:
                self.h, self.scale = h, scale

            def tree_flatten(self) -> Any:
                return (self.h,), self.scale

            @classmethod
            def tree_unflatten(cls, scale: Any, children: Any) -> Any:
                return cls(*children, scale)

    from dagdiff.core.pytrees import travels_by_value
    assert travels_by_value(Carry)

    @dd.layer
    def enc(w: Any, x: Any) -> Any:
        return Carry(jnp.tanh(x @ w))

    @dd.layer
    def dec(w: Any, c: Any, t: Any) -> Any:
        return jnp.mean((c.scale * c.h @ w - t) ** 2)

    def loss(ws: Any, c: Any, t: Any) -> Any:
        with dd.stage(0):
            h = enc(ws[0], c.h)
        with dd.stage(1):
            return dec(ws[1], h, t)

    def plain(ws: Any, c: Any, t: Any) -> Any:
        h = jnp.tanh(c.h @ ws[0])
        return jnp.mean((2.0 * h @ ws[1] - t) ** 2)

    k = jax.random.split(jax.random.PRNGKey(3), 4)
    ws = [jax.random.normal(k[0], (6, 5)) / 3, jax.random.normal(k[1], (5, 3)) / 3]
    x, t = jax.random.normal(k[2], (8, 6)), jax.random.normal(k[3], (8, 3))
    want, want_g = jax.value_and_grad(plain)(ws, Carry(x), t)
    with client2.as_current():
        got, g = dask.compute(*dd.value_and_grad(loss, microbatches=2, schedule="1f1b")(
            ws, Carry(x), t))
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want_g)):
            assert np.allclose(a, b, rtol=1e-4, atol=1e-6)
        # the class as the differentiated argument (its gradient is a Carry too)
        got, gc = dask.compute(*dd.value_and_grad(lambda c, ws, t: loss(ws, c, t))(
            Carry(x), ws, t))
        want_gc = jax.grad(lambda c: plain(ws, c, t))(Carry(x))
        assert isinstance(gc, Carry)
        assert np.allclose(gc.h, want_gc.h, rtol=1e-4, atol=1e-6)


def test_a_notebook_pytree_class_a_worker_cannot_register_is_named(client2: Any) -> None:
    """A by-value class registered with flatten functions of the user's own
    (`register_pytree_node`): the worker's error names the class and the fix."""
    import dask

    class Box:
        def __init__(self, h: Any) -> None:
            self.h = h

    jax.tree_util.register_pytree_node(Box, lambda b: ((b.h,), None),
                                       lambda _, ch: Box(*ch))

    @dd.layer
    def f(w: Any, b: Any) -> Any:
        return jnp.sum(b.h @ w)

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    assert float(dask.compute(dd.value_and_grad(f)(w, Box(x))[0], scheduler="sync")[0]) == 24.0
    with client2.as_current(), pytest.raises(Exception) as info:
        dask.compute(*dd.value_and_grad(f)(w, Box(x)))
    notes = " ".join(getattr(info.value, "__notes__", ()))
    assert "pytree class" in notes and "Box" in notes and "register_dataclass" in notes, notes
