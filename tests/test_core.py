"""Gradient parity with jax.value_and_grad for many graph shapes, on sync/threads/distributed."""
from __future__ import annotations

import functools
from typing import Any, Callable

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dask.delayed import Delayed

import dagdiff as dd
from tests import models as M

KEY = jax.random.PRNGKey(0)


def rand(i: int, shape: tuple[int, ...]) -> Any:
    return jax.random.normal(jax.random.fold_in(KEY, i), shape)


def assert_tree_close(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def, f"structure differs: {g_def} vs {w_def}"
    for a, b in zip(g_leaves, w_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def check(compute: Callable[..., Any], fn: Callable[..., Any], *args: Any, argnums: Any = 0,
          **kwargs: Any) -> None:
    ref = jax.jit(jax.value_and_grad(functools.partial(fn, **kwargs), argnums=argnums))
    want_loss, want_grads = ref(*args)
    loss, grads = dd.value_and_grad(fn, argnums=argnums)(*args, **kwargs)
    assert isinstance(loss, Delayed)
    leaves, treedef = jax.tree_util.tree_flatten(grads)   # equinox modules are dataclasses
    got_loss, got_leaves = compute(loss, leaves)
    got_grads = jax.tree_util.tree_unflatten(treedef, got_leaves)
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    assert_tree_close(got_grads, want_grads)


def test_mlp_chain(compute: Any) -> None:
    params = M.init_dense(KEY, [8, 16, 16, 4])
    check(compute, M.mlp_loss, params, rand(1, (32, 8)), rand(2, (32, 4)))


def test_residual(compute: Any) -> None:
    params = M.init_dense(KEY, [8, 8, 8, 8, 3])
    check(compute, M.residual_loss, params, rand(1, (16, 8)), rand(2, (16, 3)))


def test_branch_and_merge(compute: Any) -> None:
    params = {"stem": M.init_dense(KEY, [6, 8])[0],
              "branches": M.init_dense(jax.random.fold_in(KEY, 5), [8, 8, 8, 8]),
              "head": M.init_dense(KEY, [24, 2])[0]}
    params["branches"] = [M.init_dense(jax.random.fold_in(KEY, i), [8, 8])[0] for i in range(3)]
    check(compute, M.branch_loss, params, rand(1, (10, 6)), rand(2, (10, 2)))


def test_shared_weights(compute: Any) -> None:
    params = {"shared": M.init_dense(KEY, [5, 5])[0], "other": M.init_dense(KEY, [5, 5])[0]}
    check(compute, M.shared_loss, params, rand(1, (7, 5)), rand(2, (7, 5)))


def test_multi_input_multi_output(compute: Any) -> None:
    params = {"in": M.init_dense(KEY, [4, 6])[0], "gate": {"wg": rand(3, (6, 6))},
              "out": M.init_dense(KEY, [6, 6])[0]}
    check(compute, M.gate_loss, params, rand(1, (9, 4)), rand(2, (9, 6)))


def test_integer_labels_cross_entropy(compute: Any) -> None:
    params = M.init_dense(KEY, [5, 12, 7])
    labels = jax.random.randint(KEY, (20,), 0, 7)
    check(compute, M.classifier_loss, params, rand(1, (20, 5)), labels)


def test_two_encoders_contrastive(compute: Any) -> None:
    params = {"txt": M.init_dense(KEY, [10, 12])[0], "txt_proj": M.init_dense(KEY, [12, 6])[0],
              "img": M.init_dense(jax.random.fold_in(KEY, 1), [14, 12, 12]),
              "img_proj": M.init_dense(KEY, [12, 6])[0]}
    check(compute, M.contrastive_loss, params, rand(1, (8, 10)), rand(2, (8, 14)))


@pytest.mark.parametrize("cfg", [{"depth": 3, "residual": True}, {"depth": 5, "residual": False}])
def test_control_flow_on_config(compute: Any, cfg: dict[str, Any]) -> None:
    params = M.init_dense(KEY, [6, 6, 6])
    check(compute, M.config_loss, params, rand(1, (4, 6)), rand(2, (4, 6)), cfg=cfg)


def test_equinox_module_as_layer(compute: Any) -> None:
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(5, 3, 8, 2, key=KEY)
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    @dd.layer(name="eqx_mlp")
    def apply(p: Any, x: Any) -> Any:
        return jax.vmap(eqx.combine(p, static))(x)

    def loss_fn(p: Any, x: Any, t: Any) -> Any:
        return M.mse(apply(p, x), t)

    check(compute, loss_fn, params, rand(1, (11, 5)), rand(2, (11, 3)))


def test_argnums_tuple_and_has_aux(compute: Any) -> None:
    params = M.init_dense(KEY, [4, 4])
    x, t = rand(1, (6, 4)), rand(2, (6, 4))

    def fn(p: Any, x: Any, t: Any) -> Any:
        h = M.dense(p[0], x)
        return M.mse(h, t), {"h": h, "note": "static"}

    (loss, aux), grads = dd.value_and_grad(fn, argnums=(0, 1), has_aux=True)(params, x, t)
    (wl, waux), wg = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(params, x, t)
    got_loss, got_aux, got_grads = compute(loss, aux["h"], grads)
    np.testing.assert_allclose(got_loss, wl, rtol=1e-6)
    np.testing.assert_allclose(got_aux, waux["h"], rtol=1e-5, atol=1e-6)
    assert aux["note"] == "static"
    assert_tree_close(got_grads, wg)


def test_grad_matches_jax_grad() -> None:
    params = M.init_dense(KEY, [3, 5, 2])
    x, t = rand(1, (4, 3)), rand(2, (4, 2))
    (g,) = dask.compute(dd.grad(M.mlp_loss)(params, x, t), scheduler="sync")
    assert_tree_close(g, jax.grad(M.mlp_loss)(params, x, t))
    # `compute` as value_and_grad's (the README: "same options"; it had none)
    assert_tree_close(dd.grad(M.mlp_loss).compute(params, x, t),
                      jax.grad(M.mlp_loss)(params, x, t))
    aux_fn = lambda p, x, t: (M.mlp_loss(p, x, t), {"n": 3})      # noqa: E731
    g, aux = dd.grad(aux_fn, has_aux=True).compute(params, x, t)
    assert aux == {"n": 3}
    assert_tree_close(g, jax.grad(M.mlp_loss)(params, x, t))


def test_remat_layer_same_grads(compute: Any) -> None:
    heavy = dd.layer(M.dense.fn, name="dense_remat", remat=True)

    def fn(params: Any, x: Any, t: Any) -> Any:
        h = heavy(params[0], x)
        return M.mse(heavy(params[1], h), t)

    check(compute, fn, M.init_dense(KEY, [4, 6, 3]), rand(1, (5, 4)), rand(2, (5, 3)))


def test_float64() -> None:
    with jax.enable_x64(True):
        params = [{"w": np.random.default_rng(0).normal(size=(4, 3)), "b": np.zeros(3)}]
        x = np.random.default_rng(1).normal(size=(5, 4))
        t = np.random.default_rng(2).normal(size=(5, 3))
        loss, grads = dd.value_and_grad(M.mlp_loss)(params, x, t)
        got_l, got_g = dask.compute(loss, grads, scheduler="sync")
        want_l, want_g = jax.value_and_grad(M.mlp_loss)(params, x, t)
        assert np.asarray(got_l).dtype == np.float64
        np.testing.assert_allclose(got_l, want_l, rtol=1e-12)
        assert_tree_close(got_g, want_g, rtol=1e-12, atol=1e-14)


def test_eager_layers_run_directly() -> None:
    params = M.init_dense(KEY, [3, 4])
    x = rand(1, (2, 3))
    out = M.dense(params[0], x)                 # no tracing: just runs
    np.testing.assert_allclose(out, jnp.tanh(x @ params[0]["w"] + params[0]["b"]), rtol=1e-6)
    g = jax.jit(jax.grad(lambda p: jnp.sum(M.dense(p, x))))(params[0])   # under jax transforms
    assert g["w"].shape == (3, 4)


def test_integer_and_static_param_leaves_get_no_grad() -> None:
    params = {"w": rand(1, (3, 3)), "steps": jnp.arange(3), "name": "cfg"}

    @dd.layer
    def f(p: Any, x: Any) -> Any:
        return jnp.sum(x @ p["w"] + p["steps"])

    loss, grads = dd.value_and_grad(lambda p, x: f(p, x))(params, rand(2, (2, 3)))
    assert grads["steps"] is None and grads["name"] is None
    (gw,) = dask.compute(grads["w"], scheduler="sync")
    want = jax.grad(lambda w: jnp.sum(rand(2, (2, 3)) @ w + params["steps"]))(params["w"])
    np.testing.assert_allclose(gw, want, rtol=1e-6)


def test_unused_param_gets_zero_grad() -> None:
    params = {"used": M.init_dense(KEY, [3, 3])[0], "unused": {"w": rand(5, (2, 2))}}

    def fn(p: Any, x: Any, t: Any) -> Any:
        return M.mse(M.dense(p["used"], x), t)

    loss, grads = dd.value_and_grad(fn)(params, rand(1, (4, 3)), rand(2, (4, 3)))
    (g,) = dask.compute(grads, scheduler="threads")
    np.testing.assert_array_equal(g["unused"]["w"], np.zeros((2, 2), np.float32))
    assert_tree_close(g, jax.grad(fn)(params, rand(1, (4, 3)), rand(2, (4, 3))))


def test_a_layer_pickles_once_as_bytes_and_comes_back_whole_elsewhere() -> None:
    """Layers travel by value in every step's graph: their bytes are made once, plain
    pickle carries them (no cloudpickle pass per graph), a process that already has
    them gives back the same object, and a fresh process rebuilds a working layer."""
    import copy
    import pickle
    import subprocess
    import sys

    scale = 3.0

    def scaled_tanh(w: Any, x: Any) -> Any:        # a closure: not importable by name
        return jnp.tanh(scale * x @ w)

    lay = dd.layer(scaled_tanh, name="scaled", stage=1)
    blob = pickle.dumps(lay)
    assert pickle.dumps(lay) == blob and pickle.loads(blob) is lay
    w, x = np.eye(2, dtype=np.float32), np.ones((1, 2), np.float32)
    code = ("import pickle, sys, numpy as np; lay = pickle.loads(sys.stdin.buffer.read()); "
            "w, x = np.eye(2, dtype=np.float32), np.ones((1, 2), np.float32); "
            "print(lay.name, lay.stage, float(np.asarray(lay(w, x)).sum()))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         check=True, timeout=120).stdout.decode().split()
    assert out[:2] == ["scaled", "1"]
    np.testing.assert_allclose(float(out[2]), float(np.asarray(scaled_tanh(w, x)).sum()),
                               rtol=1e-6)
    other = copy.copy(lay)
    other.stage = 0                                 # a copy is its own layer
    assert lay.stage == 1 and pickle.loads(pickle.dumps(other)).stage == 0
    lay.name = "renamed"                            # changed after pickling: new bytes
    assert pickle.loads(pickle.dumps(lay)).name == "renamed"
