"""Worker-side pieces against independent references: the jitted functions of one layer
signature (against `jax.vjp`), and how batch data travels in a graph."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.core.spec import make_call_spec
from dagdiff.runtime.compiled import _Compiled


@dd.layer
def dense2(p: Any, x: Any) -> Any:
    return jnp.tanh(jnp.tanh(x @ p["w"] + p["b"]) @ p["v"])


def _spec_and_args(dtype: Any = np.float32) -> tuple[Any, list[Any], list[Any], Any]:
    rng = np.random.default_rng(0)
    p = {"b": rng.standard_normal(8).astype(dtype), "v": rng.standard_normal((8, 8)).astype(dtype),
         "w": rng.standard_normal((8, 8)).astype(dtype) / 3}
    x = rng.standard_normal((4, 8)).astype(dtype)
    leaves, treedef = jax.tree_util.tree_flatten(((p, x), {}))    # b, v, w, x
    spec = make_call_spec(dense2, treedef, ("d",) * 4, (None,) * 4, (True, True, True, False))
    spec = spec.with_outputs((jax.ShapeDtypeStruct((4, 8), jnp.float32),))
    return spec, leaves[:3], leaves[3:], (p, x)


@pytest.mark.parametrize("as_jax", [True, False])
def test_pullback_keeps_input_residuals_uncopied_and_matches_jax_vjp(as_jax: bool) -> None:
    spec, d, nd, (p, x) = _spec_and_args()
    if as_jax:
        d, nd = [jnp.asarray(a) for a in d], [jnp.asarray(a) for a in nd]
    c = _Compiled(spec)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.float32)
    ref_out, ref_pb = jax.vjp(lambda p: dense2.fn(p, x), p)
    (ref_g,) = ref_pb(ct)
    for _ in range(2):                       # the first call traces, the second hits the cache
        out, pb = c.fwd_vjp(d, nd)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref_out), rtol=1e-5)
        g = c.bwd(pb, [ct], (0, 1, 2))
        for got, name in zip(g, ("b", "v", "w")):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref_g[name]),
                                       rtol=1e-5, atol=1e-6)
        if as_jax:        # the second weight is a residual: the input array itself, no copy
            assert any(leaf is d[1] for leaf in jax.tree_util.tree_leaves(pb))


def test_inputs_whose_dtype_changes_in_the_trace_fall_back_to_the_plain_pullback() -> None:
    spec, d, nd, (p, x) = _spec_and_args(np.float64)    # float32 inside the trace (no x64)
    c = _Compiled(spec)
    ct = jnp.ones((4, 8), jnp.float32)
    ref = jax.vjp(lambda p: dense2.fn(p, x), p)[1](ct)[0]
    for _ in range(2):
        _, pb = c.fwd_vjp(d, nd)
        g = c.bwd(pb, [ct], (0, 1, 2))
        np.testing.assert_allclose(np.asarray(g[2]), np.asarray(ref["w"]), rtol=1e-4, atol=1e-5)
    assert c._unmatched


def test_embedded_batch_data_is_a_numpy_view_of_a_cpu_jax_array() -> None:
    from dagdiff.runtime.tasks import host_view

    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    v = host_view(x)
    assert isinstance(v, np.ndarray) and not isinstance(v, jax.Array)
    np.testing.assert_array_equal(v, np.arange(12.0).reshape(3, 4))
    assert v.ctypes.data == x.unsafe_buffer_pointer()      # a view: no copy
    n = np.ones(3)
    assert host_view(n) is n and host_view(3.0) == 3.0
    seen = []
    jax.jit(lambda t: seen.append(host_view(t) is t) or t)(x)   # a tracer stays itself
    assert seen == [True]


def test_acc_task_sums_each_leaf_as_eager_adds_do() -> None:
    """The gradient accumulator sums float leaves in one jitted call and others eagerly:
    the same values and dtypes as adding the parts one by one, a lone part passed on as
    it is, and zeros for a leaf without contributions."""
    from dagdiff.runtime.tasks import acc_task

    rng = np.random.default_rng(0)
    vals = (jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
            rng.normal(size=5).astype(np.float32),          # a NumPy array (host)
            jnp.arange(3, dtype=jnp.int32),
            jnp.asarray(rng.normal(size=2), jnp.bfloat16))
    other = tuple(v * 2 for v in vals)
    prev = tuple(v + 1 for v in vals) + (jnp.ones(2),)
    layout = tuple((((0, i), (1, i)), (np.shape(v), v.dtype)) for i, v in enumerate(vals)) \
        + (((), ((2,), np.float32)),)
    got = acc_task(layout, None, prev, vals, other)
    for i, v in enumerate(vals):
        want = v + other[i] + prev[i]
        assert got[i].dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got[i], np.float64),
                                   np.asarray(want, np.float64), rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(got[4]), np.ones(2))
    first = acc_task(((((0, 0),), ((3, 4), np.float32)),), None, None, vals)
    assert first[0] is vals[0]
    empty = acc_task(((((), ((2,), np.float32))),), None, None)
    np.testing.assert_array_equal(np.asarray(empty[0]), np.zeros(2))
