"""Tests for the hand-written kernel math: NumPy/CuPy versions, JAX wrappers, CUDA sources."""

from __future__ import annotations

import functools
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from dagdiff.kernels import (
    KERNELS,
    KernelSpec,
    bias_gelu_jax,
    cuda_impl,
    gpu_available,
    layer_norm_jax,
    softmax_cross_entropy_jax,
)
from dagdiff.kernels import numpy_impl as npk
from dagdiff.kernels import reference as ref

__all__: list[str] = []

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
CU_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
OPS = ("bias_gelu", "softmax_cross_entropy", "layer_norm")
DTYPES = (np.float32, np.float64)
# (rtol, atol) per dtype; atol is multiplied by the magnitude of the expected values.
TOL = {np.float32: (1e-5, 1e-6), np.float64: (1e-12, 1e-13)}

needs_gpu = pytest.mark.skipif(
    not gpu_available(), reason="CuPy is not installed or no CUDA device is visible"
)


def x64_if(dtype: Any) -> Any:
    """``jax.enable_x64`` for float64 work, scoped so it cannot leak into other tests."""
    return jax.enable_x64(np.dtype(dtype) == np.float64)


def assert_close(actual: Any, expected: Any, dtype: Any, slack: float = 1.0) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol * slack, atol=atol * slack * scale)


def make_inputs(op: str, dtype: Any, rng: np.random.Generator) -> tuple[Any, ...]:
    """Ordinary-sized random inputs (with a leading batch dim where the op supports it)."""
    if op == "bias_gelu":
        return (rng.normal(size=(2, 5, 24)) * 3).astype(dtype), rng.normal(size=24).astype(dtype)
    if op == "softmax_cross_entropy":
        logits = (rng.normal(size=(9, 31)) * 4).astype(dtype)
        return logits, rng.integers(0, 31, size=9).astype(np.int32)
    x = (rng.normal(size=(3, 4, 40)) * 2 + 1).astype(dtype)
    return x, rng.normal(size=40).astype(dtype), rng.normal(size=40).astype(dtype)


def reference_vjp(
    op: str, args: tuple[Any, ...], ct: np.ndarray, dtype: Any
) -> tuple[np.ndarray, tuple[Any, ...]]:
    """Reference output and cotangents (``None`` for labels) from ``jax.vjp`` in ``dtype``."""
    args = tuple(a.astype(dtype) if a.dtype.kind == "f" else a for a in args)
    ct = ct.astype(dtype)
    with x64_if(dtype):
        if op == "softmax_cross_entropy":
            out, (dlogits,) = _jitted_vjp(op, 1)(args[:1], ct, args[1])
            grads: tuple[Any, ...] = (dlogits, None)
        else:
            out, grads = _jitted_vjp(op, len(args))(args, ct)
        return np.asarray(out), tuple(None if g is None else np.asarray(g) for g in grads)


@functools.cache
def _jitted_vjp(op: str, n_diff: int) -> Callable[..., Any]:
    """One jitted (output, vjp) of the reference per op: fewer tiny eager compiles."""
    fn = KERNELS[op].reference

    def run(diff: tuple[Any, ...], ct: Any, *rest: Any) -> tuple[Any, Any]:
        out, vjp = jax.vjp(lambda *d: fn(*d, *rest), *diff)
        return out, vjp(ct)

    del n_diff  # cache key only
    return jax.jit(run)


def check_against_reference(
    op: str,
    args: tuple[Any, ...],
    dtype: Any,
    rng: np.random.Generator,
    slack: float = 1.0,
    ref_dtype: Any = None,
) -> None:
    """NumPy fwd/bwd vs the jnp reference (run in ``ref_dtype``, default ``dtype``)."""
    spec = KERNELS[op]
    out, res = spec.numpy_fwd(*args)
    ct = np.asarray(rng.normal(size=np.shape(out)), dtype=dtype)
    ref_out, ref_grads = reference_vjp(op, args, ct, ref_dtype or dtype)
    ref_out = ref_out.astype(dtype)
    ref_grads = tuple(None if g is None else g.astype(dtype) for g in ref_grads)
    assert_close(out, ref_out, dtype, slack)
    grads = spec.numpy_bwd(res, ct)
    assert len(grads) == len(args)
    for g, rg in zip(grads, ref_grads):
        if rg is None:
            assert g is None
        else:
            assert np.all(np.isfinite(g))
            assert_close(g, rg, dtype, slack)


# ------------------------------------------------------------------- NumPy vs reference


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("op", OPS)
def test_numpy_fwd_bwd_match_reference(op: str, dtype: Any) -> None:
    rng = np.random.default_rng(0)
    check_against_reference(op, make_inputs(op, dtype, rng), dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_bias_gelu_large_inputs(dtype: Any) -> None:
    rng = np.random.default_rng(1)
    # Moderately large |x|, still within the reference's own finite range. The float32 reference
    # flushes gelu'(-5) ~ -1.5e-6 to 0 (tanh rounds to -1), so judge float32 against float64.
    x = np.array([[-1e3, -60.0, -12.0, -5.0, -1e-4, 0.0, 1e-4, 5.0, 12.0, 60.0, 1e3, 3e4]], dtype)
    b = np.zeros(x.shape[1], dtype)
    check_against_reference("bias_gelu", (x, b), dtype, rng, ref_dtype=np.float64)
    # Huge |x| (x**3 overflows, the reference's grad would be NaN): exact limits, no NaN.
    huge = np.array([-1e30, -1e20, -1e12, 1e12, 1e20, 1e30], dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out, res = npk.bias_gelu_fwd(huge, np.zeros(6, dtype))
        dx, db = npk.bias_gelu_bwd(res, np.ones(6, dtype))
    np.testing.assert_array_equal(out, np.where(huge > 0, huge, 0))
    np.testing.assert_array_equal(dx, (huge > 0).astype(dtype))
    assert db.shape == (6,) and db.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_softmax_cross_entropy_extreme_logits(dtype: Any) -> None:
    rng = np.random.default_rng(2)
    # Logits around +-1e4 with O(1) spread, and one row where a single logit dominates.
    logits = (1e4 * rng.choice([-1.0, 1.0], size=(6, 1)) + rng.normal(size=(6, 40))).astype(dtype)
    logits[0, 3] = 2e4
    labels = rng.integers(0, 40, size=6)
    labels[0] = 3
    with np.errstate(over="raise", invalid="raise"):
        check_against_reference("softmax_cross_entropy", (logits, labels), dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_softmax_cross_entropy_wide_rows(dtype: Any) -> None:
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(4, 50_000)) * 3 + 1e4).astype(dtype)
    labels = np.array([0, 17, 49_999, 25_000])
    # Summing 50k exponentials in float32 in a different order than XLA costs a few ulps more.
    check_against_reference("softmax_cross_entropy", (logits, labels), dtype, rng, slack=4.0)
    dlogits, none = npk.softmax_cross_entropy_bwd(
        npk.softmax_cross_entropy_fwd(logits, labels)[1], np.asarray(1.0, dtype)
    )
    assert none is None
    # Each row of softmax - onehot sums to zero.
    np.testing.assert_allclose(dlogits.sum(axis=1), 0.0, atol=50 * np.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_layer_norm_zero_variance_rows(dtype: Any) -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 33)).astype(dtype)
    x[0] = 3.0
    x[1] = 0.0
    x[2] = -1e4
    gamma, beta = rng.normal(size=33).astype(dtype), rng.normal(size=33).astype(dtype)
    check_against_reference("layer_norm", (x, gamma, beta), dtype, rng)
    y, (_, _, mean, rstd) = npk.layer_norm_fwd(x, gamma, beta)
    np.testing.assert_array_equal(y[:3], np.broadcast_to(beta, (3, 33)))  # xhat == 0 exactly
    np.testing.assert_allclose(rstd[:3], 1 / np.sqrt(1e-5), rtol=1e-6)
    # Large offset, small spread (condition number ~1e3): the two-pass variance loses only what
    # the conditioning costs, where a one-pass E[x^2] - E[x]^2 would lose all float32 digits.
    x_off = (1e3 + rng.normal(size=(3, 33))).astype(dtype)
    check_against_reference(
        "layer_norm", (x_off, gamma, beta), dtype, rng, slack=100.0, ref_dtype=np.float64
    )


def test_residuals_are_picklable_numpy_arrays() -> None:
    rng = np.random.default_rng(5)
    for op in OPS:
        args = make_inputs(op, np.float32, rng)
        out, res = KERNELS[op].numpy_fwd(*args)
        assert isinstance(res, tuple) and all(isinstance(r, np.ndarray) for r in res)
        ct = np.ones_like(out)
        before = KERNELS[op].numpy_bwd(res, ct)
        after = KERNELS[op].numpy_bwd(pickle.loads(pickle.dumps(res)), ct)
        for a, b in zip(before, after):
            assert (a is None and b is None) or np.array_equal(a, b)


def test_numpy_input_validation() -> None:
    logits = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError):
        npk.softmax_cross_entropy_fwd(logits, np.array([0, 1, 4]))
    with pytest.raises(ValueError):
        npk.softmax_cross_entropy_fwd(logits, np.array([0, -1, 2]))
    with pytest.raises(TypeError):
        npk.softmax_cross_entropy_fwd(logits, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError):
        npk.bias_gelu_fwd(np.zeros((2, 3)), np.zeros(4))
    with pytest.raises(ValueError):
        npk.layer_norm_fwd(np.zeros((2, 3)), np.ones(3), np.zeros(2))
    with pytest.raises(TypeError):
        npk.bias_gelu_fwd(np.zeros((2, 3), np.int32), np.zeros(3, np.int32))


# ------------------------------------------------------------------------- JAX wrappers


def test_wrappers_check_grads_float64() -> None:
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        x, b = (jnp.asarray(a) for a in make_inputs("bias_gelu", np.float64, rng))
        check_grads(bias_gelu_jax, (x[0, :2], b), order=1, modes=["rev"])
        logits, labels = make_inputs("softmax_cross_entropy", np.float64, rng)
        labels = jnp.asarray(labels)
        check_grads(
            lambda z: softmax_cross_entropy_jax(z, labels), (jnp.asarray(logits),), order=1,
            modes=["rev"],
        )
        x, gamma, beta = (jnp.asarray(a) for a in make_inputs("layer_norm", np.float64, rng))
        check_grads(
            lambda *a: layer_norm_jax(*a, eps=1e-3), (x[0, :2], gamma, beta), order=1,
            modes=["rev"],
        )


def test_wrappers_forward_values_and_dtypes() -> None:
    rng = np.random.default_rng(7)
    for op, fn in (
        ("bias_gelu", bias_gelu_jax),
        ("softmax_cross_entropy", softmax_cross_entropy_jax),
        ("layer_norm", layer_norm_jax),
    ):
        args = make_inputs(op, np.float32, rng)
        got = fn(*args)
        assert isinstance(got, jax.Array) and got.dtype == jnp.float32
        assert_close(got, KERNELS[op].numpy_fwd(*args)[0], np.float32)
    with pytest.raises(ValueError):
        bias_gelu_jax(jnp.zeros((2, 3)), jnp.zeros(4))
    with pytest.raises(TypeError):
        softmax_cross_entropy_jax(jnp.zeros((2, 3)), jnp.zeros(2))


def _tiny_model(
    gelu: Callable[..., Any], xent: Callable[..., Any], norm: Callable[..., Any]
) -> Callable[..., Any]:
    def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        h = norm(x @ params["w1"], params["gamma"], params["beta"])
        h = gelu(h, params["b1"])
        return xent(h @ params["w2"], y)

    return loss


def test_grad_and_jit_of_tiny_model_match_reference() -> None:
    rng = np.random.default_rng(8)
    params = {
        "w1": jnp.asarray(rng.normal(size=(12, 16)) / 4, jnp.float32),
        "gamma": jnp.asarray(1 + rng.normal(size=16) / 10, jnp.float32),
        "beta": jnp.asarray(rng.normal(size=16) / 10, jnp.float32),
        "b1": jnp.asarray(rng.normal(size=16) / 10, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(16, 7)) / 4, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(10, 12)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 7, size=10), jnp.int32)
    mine = _tiny_model(bias_gelu_jax, softmax_cross_entropy_jax, layer_norm_jax)
    theirs = _tiny_model(ref.bias_gelu_ref, ref.softmax_cross_entropy_ref, ref.layer_norm_ref)
    want_loss, want = jax.value_and_grad(theirs)(params, x, y)
    for fn in (jax.value_and_grad(mine), jax.jit(jax.value_and_grad(mine))):
        got_loss, got = fn(params, x, y)
        assert_close(got_loss, want_loss, np.float32, slack=2.0)
        for key in params:
            assert_close(got[key], want[key], np.float32, slack=2.0)


def test_wrappers_under_vmap() -> None:
    rng = np.random.default_rng(9)
    x, gamma, beta = make_inputs("layer_norm", np.float32, rng)
    got = jax.vmap(layer_norm_jax, in_axes=(0, None, None))(x, gamma, beta)
    assert_close(got, ref.layer_norm_ref(x, gamma, beta), np.float32, slack=2.0)
    xb, b = make_inputs("bias_gelu", np.float32, rng)
    grad = jax.grad(lambda bb: jax.vmap(bias_gelu_jax, in_axes=(0, None))(xb, bb).sum())(b)
    want = jax.grad(lambda bb: ref.bias_gelu_ref(xb, bb).sum())(b)
    assert_close(grad, want, np.float32, slack=4.0)


# ----------------------------------------------------------------------------- registry


def test_registry_and_dispatch() -> None:
    assert set(KERNELS) == set(OPS)
    rng = np.random.default_rng(10)
    for op in OPS:
        spec = KERNELS[op]
        assert isinstance(spec, KernelSpec) and spec.name == op
        with pytest.raises(AttributeError):
            spec.name = "x"  # type: ignore[misc]
        args = make_inputs(op, np.float32, rng)
        out, res = spec.fwd(*args)
        assert isinstance(out, np.ndarray)
        want_out, want_res = spec.numpy_fwd(*args)
        np.testing.assert_array_equal(out, want_out)
        grads = spec.bwd(res, np.ones_like(out))
        # JAX (CPU) inputs are dispatched to NumPy and come back as JAX arrays.
        jout, jres = spec.fwd(*(jnp.asarray(a) for a in args))
        assert isinstance(jout, jax.Array)
        assert_close(jout, want_out, np.float32)
        jgrads = spec.bwd(jres, jnp.ones_like(jout))
        for g, jg in zip(grads, jgrads):
            if g is None:
                assert jg is None
            else:
                assert isinstance(jg, jax.Array)
                assert_close(jg, g, np.float32)


def test_gpu_available_is_bool() -> None:
    assert isinstance(gpu_available(), bool)


# --------------------------------------------------------------------------- CUDA sources


def test_kernel_sources_are_found() -> None:
    assert {"bias_gelu.cu", "layer_norm.cu", "softmax_cross_entropy.cu"} <= set(CU_FILES)
    for name in CU_FILES:
        assert 'extern "C" __global__' in cuda_impl._kernel_source(name)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name", CU_FILES)
def test_cuda_sources_compile_with_nvcc(name: str, tmp_path: Path) -> None:
    ptx = tmp_path / (name + ".ptx")
    proc = subprocess.run(
        ["nvcc", "--ptx", "-std=c++14", "-o", str(ptx), str(KERNEL_DIR / name)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    stem = {"softmax_cross_entropy.cu": "softmax_xent"}.get(name, name[: -len(".cu")])
    for kind in ("fwd", "bwd"):
        for tag in ("f32", "f64"):
            assert f".entry {stem}_{kind}_{tag}(" in text


# ------------------------------------------------------------------------------ CuPy/GPU


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("op", OPS)
def test_cuda_matches_numpy(op: str, dtype: Any) -> None:
    import cupy

    rng = np.random.default_rng(11)
    spec = KERNELS[op]
    cases = [make_inputs(op, dtype, rng)]
    if op == "softmax_cross_entropy":
        wide = (rng.normal(size=(3, 50_000)) * 3 + 1e4).astype(dtype)
        cases.append((wide, np.array([0, 49_999, 123])))
    if op == "layer_norm":
        x, gamma, beta = make_inputs(op, dtype, rng)
        x[0, 0] = 2.0
        cases.append((x, gamma, beta))
    slack = 4.0 if dtype == np.float32 else 10.0
    for args in cases:
        want, want_res = spec.numpy_fwd(*args)
        got, res = spec.cuda_fwd(*(cupy.asarray(a) for a in args))
        assert isinstance(got, cupy.ndarray)
        assert_close(cupy.asnumpy(got), want, dtype, slack)
        ct = np.asarray(rng.normal(size=np.shape(want)), dtype=dtype)
        want_grads = spec.numpy_bwd(want_res, ct)
        grads = spec.cuda_bwd(res, cupy.asarray(ct))
        for g, wg in zip(grads, want_grads):
            if wg is None:
                assert g is None
            else:
                assert_close(cupy.asnumpy(g), wg, dtype, slack)


@needs_gpu
def test_cuda_dlpack_and_dispatch() -> None:
    import cupy

    from dagdiff.kernels import to_cupy, to_jax

    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")] if _jax_has_gpu() else []
    a = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    if gpus:
        j = to_jax(a)
        np.testing.assert_array_equal(np.asarray(j), cupy.asnumpy(a))
        np.testing.assert_array_equal(cupy.asnumpy(to_cupy(j)), cupy.asnumpy(a))
    rng = np.random.default_rng(12)
    x, b = make_inputs("bias_gelu", np.float32, rng)
    out, res = KERNELS["bias_gelu"].fwd(cupy.asarray(x), cupy.asarray(b))
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out), npk.bias_gelu_fwd(x, b)[0], np.float32, 4.0)


def _jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def test_out_of_range_labels_are_named_before_the_callback() -> None:
    """Concrete labels outside the logits' classes: a ValueError naming the range (it was
    an INTERNAL error of jax.pure_callback, the reason buried in its traceback)."""
    import dagdiff as dd
    from dagdiff.kernels import softmax_cross_entropy_jax

    logits = np.zeros((3, 5), np.float32)
    for fn in (softmax_cross_entropy_jax, dd.kernels.softmax_cross_entropy):
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*from 0 to 7"):
            fn(logits, np.array([0, 1, 7]))
        with pytest.raises(ValueError, match=r"from -1 to 1"):
            fn(logits, np.array([0, 1, -1]))
    assert np.isclose(float(softmax_cross_entropy_jax(logits, np.array([0, 1, 4]))),
                      np.log(5), rtol=1e-6)
