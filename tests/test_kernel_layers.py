"""Hand-written kernels as graph layers: parity with jax.grad of the all-JAX model, residuals
that travel between workers without rematerialization, and rule validation."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.kernels import reference as R

KEY = jax.random.PRNGKey(5)


@dd.layer
def matmul(w: Any, h: Any) -> Any:
    return h @ w


class JaxOps:
    bias_gelu = staticmethod(R.bias_gelu_ref)
    layer_norm = staticmethod(R.layer_norm_ref)
    softmax_cross_entropy = staticmethod(R.softmax_cross_entropy_ref)


def model(p: Any, x: Any, y: Any, k: Any = dd.kernels) -> Any:
    with dd.stage(0):
        h = k.bias_gelu(matmul(p["w1"], x), p["b1"])
        h = k.layer_norm(h, p["g"], p["beta"], eps=1e-5)
    with dd.stage(1):
        return k.softmax_cross_entropy(matmul(p["w2"], h), y)


def setup() -> tuple[Any, Any, Any]:
    params = {"w1": jax.random.normal(KEY, (8, 16)) * 0.3, "b1": jnp.full(16, 0.1),
              "g": jnp.ones(16) * 1.1, "beta": jnp.full(16, 0.05),
              "w2": jax.random.normal(jax.random.fold_in(KEY, 1), (16, 5)) * 0.3}
    x = jax.random.normal(jax.random.fold_in(KEY, 2), (12, 8))
    y = jax.random.randint(KEY, (12,), 0, 5)
    return params, x, y


def close(a: Any, b: Any) -> None:
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_kernel_layers_match_jax_on_threads() -> None:
    params, x, y = setup()
    want = jax.value_and_grad(lambda p, x, y: model(p, x, y, JaxOps))(params, x, y)
    loss, grads = dd.value_and_grad(model)(params, x, y)
    phases = {(dd.key_info(k).phase, dd.key_info(k).layer) for k in loss.__dask_graph__()}
    assert {("F", "bias_gelu"), ("B", "bias_gelu"), ("F", "layer_norm"),
            ("B", "softmax_cross_entropy")} <= phases
    got = dask.compute(loss, grads, scheduler="threads")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    close(got[1], want[1])


def test_kernels_inside_plain_jax() -> None:
    params, x, y = setup()
    g = jax.jit(jax.grad(model))(params, x, y)            # custom_vjp wrappers, no tracing
    close(g, jax.grad(lambda p, x, y: model(p, x, y, JaxOps))(params, x, y))


@pytest.mark.distributed
def test_residuals_travel_between_workers_without_remat(client2: Any) -> None:
    """Kernel forwards pinned to one worker, their VJPs to the other: residuals are plain
    arrays, so they move and nothing is recomputed (remat counter stays 0)."""
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    params, x, y = setup()
    loss, grads = dd.value_and_grad(model, resident=False)(params, x, y)
    g = dict(loss.__dask_graph__())
    a, b = sorted(client2.scheduler_info()["workers"])
    kernel = {"bias_gelu", "layer_norm", "softmax_cross_entropy"}
    where = {k: (a if dd.key_info(k).phase == "F" else b)
             for k in g if dd.key_info(k).layer in kernel and dd.key_info(k).phase in "FB"}
    layer = MaterializedLayer(g, annotations={"workers": where.get})
    hlg = HighLevelGraph({"g": layer}, {"g": set()})
    outs = [Delayed(loss.key, hlg, layer="g")] + [
        Delayed(d.key, hlg, layer="g") for d in jax.tree_util.tree_leaves(grads)]
    dd.reset_remat_count(client2)
    from distributed import get_task_stream

    with get_task_stream(client2) as ts:
        got = client2.compute(outs, sync=True)
    ran = {r["key"]: r["worker"] for r in ts.data}
    for k, w in where.items():
        assert ran[k] == w
    want_l, want_g = jax.value_and_grad(lambda p, x, y: model(p, x, y, JaxOps))(params, x, y)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1:], jax.tree_util.tree_leaves(want_g))
    assert dd.remat_count(client2) == 0


def test_kernels_take_float64_numpy_and_mixed_precision_inputs_in_a_graph() -> None:
    """Parameters made with NumPy (float64, which JAX computes in float32) and a float16
    input with a float32 bias: the kernels' rules return cotangents in the precision
    they computed in, which the graph refused ("cotangents must have the argument's
    shape and dtype") where jax.grad takes them. Gradients now equal jax.grad's of the
    reference math, in the dtype JAX gives each argument."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6))
    p = {"g": rng.normal(size=6) + 1.0, "b": rng.normal(size=6)}

    @dd.layer
    def total(h: Any) -> Any:
        return jnp.sum(h.astype(jnp.float32) ** 2)

    loss, grads = dask.compute(*dd.value_and_grad(
        lambda p, x: total(dd.kernels.layer_norm(x, p["g"], p["b"])))(p, x), scheduler="sync")
    want, want_g = jax.value_and_grad(
        lambda p, x: jnp.sum(R.layer_norm_ref(x, p["g"], p["b"]) ** 2))(p, x)
    assert grads["g"].dtype == want_g["g"].dtype == jnp.float32
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    close(grads, want_g)
    x16, b32 = jnp.asarray(x, jnp.float16), jnp.asarray(p["b"], jnp.float32)
    (gx, gb) = dask.compute(dd.grad(lambda x, b: total(dd.kernels.bias_gelu(x, b)),
                                    argnums=(0, 1))(x16, b32), scheduler="sync")[0]
    wx, wb = jax.grad(lambda x, b: jnp.sum(R.bias_gelu_ref(x, b).astype(jnp.float32) ** 2),
                      argnums=(0, 1))(x16, b32)
    assert (gx.dtype, gb.dtype) == (wx.dtype, wb.dtype) == (jnp.float16, jnp.float32)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(wx, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(gb, wb, rtol=2e-2, atol=2e-2)


def test_custom_rule_errors_name_the_kernel() -> None:
    def fwd(x: Any, w: Any) -> Any:
        return np.asarray(x) * np.asarray(w), (np.asarray(x), np.asarray(w))

    def bad_bwd(res: Any, ct: Any) -> Any:
        x, w = res
        return ct * w, np.zeros(3, np.float32)          # wrong shape for w

    scale = dd.custom_layer(fwd, bad_bwd, name="scale_kernel")
    x, w = jnp.ones((2, 4)), jnp.ones(4)
    loss, grads = dd.value_and_grad(lambda w, x: dd.kernels.softmax_cross_entropy(
        scale(x, w), jnp.zeros(2, jnp.int32)))(w, x)
    with pytest.raises(dd.CustomRuleError,
                       match=r"scale_kernel.*float32\[3\].*float32\[4\]"):
        dask.compute(grads, scheduler="sync")


def test_custom_layer_without_jax_version() -> None:
    def fwd(x: Any) -> Any:
        x = np.asarray(x)
        return np.sin(x), (x,)

    def bwd(res: Any, ct: Any) -> Any:
        (x,) = res
        return (np.cos(x) * np.asarray(ct),)

    sin = dd.custom_layer(fwd, bwd, name="np_sin")

    @dd.layer
    def total(h: Any) -> Any:
        return jnp.sum(h * h)

    x = jnp.linspace(-1.0, 1.0, 5)
    loss, g = dd.value_and_grad(lambda x: total(sin(x)))(x)
    got = dask.compute(loss, g, scheduler="threads")
    np.testing.assert_allclose(got[1], jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x),
                               rtol=1e-6)


def _np_matmul() -> Any:
    """A NumPy matmul as a custom layer without a JAX version, with an integer argument
    (a row mask, not differentiated) to show None cotangents."""
    def fwd(x: Any, w: Any, keep: Any) -> Any:
        x, w, keep = np.asarray(x), np.asarray(w), np.asarray(keep)
        return (x @ w) * keep[:, None], (x, w, keep)

    def bwd(res: Any, ct: Any) -> Any:
        x, w, keep = res
        ct = np.asarray(ct) * keep[:, None]
        return ct @ w.T, x.T @ ct, None

    return dd.custom_layer(fwd, bwd, name="np_matmul")


def test_custom_layer_without_jax_version_under_jax_transforms() -> None:
    """jax.jit, jax.grad and a dd.layer calling it run the rules (they gave zeros)."""
    mm = _np_matmul()
    x = jnp.arange(8.0).reshape(2, 4) / 8
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    keep = jnp.array([1, 0], jnp.int32)

    def ref(w: Any, x: Any) -> Any:
        return jnp.sum(jnp.tanh((x @ w) * keep[:, None]) ** 2)

    np.testing.assert_allclose(jax.jit(mm)(x, w, keep), (x @ w) * keep[:, None], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(mm(x, w, keep) ** 2))(w),
                               jax.grad(lambda w: jnp.sum(((x @ w) * keep[:, None]) ** 2))(w),
                               rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(lambda x: mm(x[None], w, keep[:1])[0])(x),
                               x @ w, rtol=1e-6)

    @dd.layer
    def block(w: Any, x: Any) -> Any:          # the custom layer inside a JAX layer
        return jnp.tanh(mm(x, w, keep))

    @dd.layer
    def total(y: Any) -> Any:
        return jnp.sum(y ** 2)

    loss, g = dask.compute(*dd.value_and_grad(lambda w, x: total(block(w, x)))(w, x),
                           scheduler="sync")
    want_loss, want_g = jax.value_and_grad(ref)(w, x)
    assert float(want_loss) > 0.1
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["nested", "dict"])
def test_custom_layer_bwd_gets_the_outputs_structure(kind: str) -> None:
    """A rule with a pytree output gets its cotangent in that structure, in the graph and
    under jax.grad (it got a flat tuple of leaves in the graph)."""
    def fwd(x: Any, w: Any) -> Any:
        x, w = np.asarray(x), np.asarray(w)
        y = x @ w
        out = (y, (2 * y, 3 * y)) if kind == "nested" else {"a": y, "b": 2 * y}
        return out, (x, w)

    def bwd(res: Any, ct: Any) -> Any:
        x, w = res
        if kind == "nested":
            a, (b, c) = ct
            g = np.asarray(a) + 2 * np.asarray(b) + 3 * np.asarray(c)
        else:
            g = np.asarray(ct["a"]) + 2 * np.asarray(ct["b"])
        return g @ w.T, x.T @ g

    op = dd.custom_layer(fwd, bwd, name=f"op_{kind}")

    def reduce(o: Any) -> Any:
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree_util.tree_leaves(o))

    def ref(w: Any, x: Any) -> Any:
        y = x @ w
        return reduce((y, (2 * y, 3 * y)) if kind == "nested" else {"a": y, "b": 2 * y})

    total = dd.layer(reduce, name="reduce")
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    w = jnp.linspace(0.5, -0.5, 12).reshape(4, 3)
    want_loss, want_g = jax.value_and_grad(ref)(w, x)
    loss, g = dask.compute(*dd.value_and_grad(lambda w, x: total(op(x, w)))(w, x),
                           scheduler="sync")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.grad(lambda w: reduce(op(x, w)))(w), want_g, rtol=1e-5,
                               atol=1e-7)
