"""Hand-written fused kernels (NumPy and CuPy/CUDA) with JAX ``custom_vjp`` wrappers."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import cuda_impl, numpy_impl, reference
from .cuda_impl import gpu_available, to_cupy, to_jax


__all__ = [
    "KERNELS",
    "KernelSpec",
    "bias_gelu_jax",
    "gpu_available",
    "layer_norm_jax",
    "softmax_cross_entropy_jax",
    "to_cupy",
    "to_jax",
]

# The ``*_jax`` wrappers are ``jax.custom_vjp`` functions whose forward and backward rules run
# the NumPy implementation (or the CuPy one, when the inputs live on a GPU and CuPy sees a CUDA
# device) inside ``jax.pure_callback``. They work under ``jax.jit``, ``jax.grad`` and
# ``jax.vmap`` (callbacks are mapped sequentially). The host/GPU choice is made at trace time:
# from the inputs' devices when they are concrete arrays, else from ``jax.default_backend()``.
# Inside a callback the operands are host NumPy arrays, so the GPU path copies through the host.

_GPU_PLATFORMS = frozenset({"gpu", "cuda"})


def _sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _jax_on_gpu(a: Any) -> bool:
    try:
        return any(dev.platform in _GPU_PLATFORMS for dev in a.devices())
    except Exception:
        return False


def _use_gpu(*arrays: Any) -> bool:
    """Trace-time choice of implementation for the ``*_jax`` wrappers."""
    concrete = [
        a for a in arrays if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
    ]
    if concrete:
        on_gpu = any(_jax_on_gpu(a) for a in concrete)
    else:
        on_gpu = jax.default_backend() in _GPU_PLATFORMS
    return on_gpu and gpu_available()


def _to_host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") and type(a).__module__.startswith("cupy") else a


def _host_fn(np_fn: Callable[..., Any], cu_fn: Callable[..., Any], use_gpu: bool) -> Callable:
    """``np_fn``, or ``cu_fn`` with its (CuPy) results copied back to NumPy."""
    if not use_gpu:
        return np_fn

    def run(*args: Any, **kwargs: Any) -> Any:
        return jax.tree.map(_to_host, cu_fn(*args, **kwargs))

    return run


def _check_float(dtype: Any, what: str) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{what} must be floating point, got dtype {dtype}")


# ----------------------------------------------------------------------------- bias_gelu


@jax.custom_vjp
def _bias_gelu_cvjp(x: jax.Array, b: jax.Array) -> jax.Array:
    return _bias_gelu_fwd_rule(x, b)[0]


def _bias_gelu_fwd_rule(x: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
    fwd = _host_fn(numpy_impl.bias_gelu_fwd, cuda_impl.bias_gelu_fwd, _use_gpu(x, b))

    def callback(xh: np.ndarray, bh: np.ndarray) -> np.ndarray:
        return np.asarray(fwd(xh, bh)[0], dtype=x.dtype)

    out = jax.pure_callback(
        callback, _sds(x.shape, x.dtype), x, b, vmap_method="sequential"
    )
    return out, (x, b)


def _bias_gelu_bwd_rule(res: tuple[Any, ...], ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, b = res
    bwd = _host_fn(numpy_impl.bias_gelu_bwd, cuda_impl.bias_gelu_bwd, _use_gpu(x, b, ct))

    def callback(xh: np.ndarray, bh: np.ndarray, cth: np.ndarray) -> tuple[np.ndarray, ...]:
        dx, db = bwd((xh, bh), cth)
        return np.asarray(dx, dtype=x.dtype), np.asarray(db, dtype=b.dtype)

    dx, db = jax.pure_callback(
        callback,
        (_sds(x.shape, x.dtype), _sds(b.shape, b.dtype)),
        x,
        b,
        ct,
        vmap_method="sequential",
    )
    return dx, db


_bias_gelu_cvjp.defvjp(_bias_gelu_fwd_rule, _bias_gelu_bwd_rule)


def bias_gelu_jax(x: jax.typing.ArrayLike, b: jax.typing.ArrayLike) -> jax.Array:
    """``gelu_tanh(x + b)`` (``x: [..., d]``, ``b: [d]``) with a hand-written VJP."""
    x, b = jnp.asarray(x), jnp.asarray(b)
    if b.ndim != 1 or x.ndim < 1 or x.shape[-1] != b.shape[0]:
        raise ValueError(f"bias_gelu expects x [..., d] and b [d], got {x.shape} and {b.shape}")
    dtype = jnp.result_type(x, b)
    _check_float(dtype, "bias_gelu inputs")
    return _bias_gelu_cvjp(x.astype(dtype), b.astype(dtype))


# ----------------------------------------------------------------- softmax_cross_entropy


@jax.custom_vjp
def _softmax_xent_cvjp(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return _softmax_xent_fwd_rule(logits, labels)[0]


def _softmax_xent_fwd_rule(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, tuple[Any, ...]]:
    fwd = _host_fn(
        numpy_impl.softmax_cross_entropy_fwd,
        cuda_impl.softmax_cross_entropy_fwd,
        _use_gpu(logits, labels),
    )
    n = logits.shape[0]
    work = numpy_impl._work_dtype(logits.dtype)

    def callback(lh: np.ndarray, yh: np.ndarray) -> tuple[np.ndarray, ...]:
        out, (_, _, row_max, row_lse) = fwd(lh, yh)
        return (
            np.asarray(out, dtype=logits.dtype),
            np.asarray(row_max, dtype=work),
            np.asarray(row_lse, dtype=work),
        )

    out, row_max, row_lse = jax.pure_callback(
        callback,
        (_sds((), logits.dtype), _sds((n,), work), _sds((n,), work)),
        logits,
        labels,
        vmap_method="sequential",
    )
    return out, (logits, labels, row_max, row_lse)


def _softmax_xent_bwd_rule(res: tuple[Any, ...], ct: jax.Array) -> tuple[jax.Array, None]:
    logits = res[0]
    bwd = _host_fn(
        numpy_impl.softmax_cross_entropy_bwd,
        cuda_impl.softmax_cross_entropy_bwd,
        _use_gpu(*res, ct),
    )

    def callback(*args: np.ndarray) -> np.ndarray:
        return np.asarray(bwd(args[:4], args[4])[0], dtype=logits.dtype)

    dlogits = jax.pure_callback(
        callback, _sds(logits.shape, logits.dtype), *res, ct, vmap_method="sequential"
    )
    return dlogits, None  # integer labels: no cotangent


_softmax_xent_cvjp.defvjp(_softmax_xent_fwd_rule, _softmax_xent_bwd_rule)


def softmax_cross_entropy_jax(
    logits: jax.typing.ArrayLike, labels: jax.typing.ArrayLike
) -> jax.Array:
    """Mean softmax cross-entropy of ``logits: [n, V]`` and integer ``labels: [n]``.

    Differentiable in ``logits`` only; ``labels`` get a zero (``None``) cotangent.
    """
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [n, V] and labels [n], got {logits.shape} and {labels.shape}"
        )
    _check_float(logits.dtype, "logits")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    if not isinstance(labels, jax.core.Tracer) and labels.size:
        # concrete labels are checked here: inside the callback the same check surfaces
        # as an INTERNAL error of jax.pure_callback (traced labels can only be checked there)
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= logits.shape[1]:
            raise ValueError(f"labels must lie in [0, {logits.shape[1]}) (the logits' "
                             f"{logits.shape[1]} classes), got labels from {low} to {high}")
    return _softmax_xent_cvjp(logits, labels)


# ---------------------------------------------------------------------------- layer_norm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_cvjp(x: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float) -> jax.Array:
    return _layer_norm_fwd_rule(x, gamma, beta, eps)[0]


def _layer_norm_fwd_rule(
    x: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float
) -> tuple[jax.Array, tuple[Any, ...]]:
    fwd = _host_fn(numpy_impl.layer_norm_fwd, cuda_impl.layer_norm_fwd, _use_gpu(x, gamma, beta))
    work = numpy_impl._work_dtype(x.dtype)
    lead = x.shape[:-1]

    def callback(xh: np.ndarray, gh: np.ndarray, bh: np.ndarray) -> tuple[np.ndarray, ...]:
        y, (_, _, mean, rstd) = fwd(xh, gh, bh, eps=eps)
        return (
            np.asarray(y, dtype=x.dtype),
            np.asarray(mean, dtype=work).reshape(lead),
            np.asarray(rstd, dtype=work).reshape(lead),
        )

    y, mean, rstd = jax.pure_callback(
        callback,
        (_sds(x.shape, x.dtype), _sds(lead, work), _sds(lead, work)),
        x,
        gamma,
        beta,
        vmap_method="sequential",
    )
    return y, (x, gamma, mean, rstd)


def _layer_norm_bwd_rule(
    eps: float, res: tuple[Any, ...], ct: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    del eps  # rstd already includes it
    x, gamma = res[0], res[1]
    bwd = _host_fn(numpy_impl.layer_norm_bwd, cuda_impl.layer_norm_bwd, _use_gpu(*res, ct))

    def callback(*args: np.ndarray) -> tuple[np.ndarray, ...]:
        dx, dgamma, dbeta = bwd(args[:4], args[4])
        return (
            np.asarray(dx, dtype=x.dtype),
            np.asarray(dgamma, dtype=gamma.dtype),
            np.asarray(dbeta, dtype=gamma.dtype),
        )

    dx, dgamma, dbeta = jax.pure_callback(
        callback,
        (_sds(x.shape, x.dtype), _sds(gamma.shape, gamma.dtype), _sds(gamma.shape, gamma.dtype)),
        *res,
        ct,
        vmap_method="sequential",
    )
    return dx, dgamma, dbeta


_layer_norm_cvjp.defvjp(_layer_norm_fwd_rule, _layer_norm_bwd_rule)


def layer_norm_jax(
    x: jax.typing.ArrayLike,
    gamma: jax.typing.ArrayLike,
    beta: jax.typing.ArrayLike,
    eps: float = 1e-5,
) -> jax.Array:
    """Layer norm of ``x: [..., d]`` over the last axis with a hand-written VJP."""
    x, gamma, beta = jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(beta)
    d = x.shape[-1] if x.ndim else None
    if x.ndim < 1 or gamma.shape != (d,) or beta.shape != (d,):
        raise ValueError(
            f"layer_norm expects x [..., d], gamma [d], beta [d]; got {x.shape}, "
            f"{gamma.shape}, {beta.shape}"
        )
    dtype = jnp.result_type(x, gamma, beta)
    _check_float(dtype, "layer_norm inputs")
    return _layer_norm_cvjp(x.astype(dtype), gamma.astype(dtype), beta.astype(dtype), float(eps))


# ------------------------------------------------------------------------------ registry


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One hand-written op: dispatching and per-backend fwd/bwd plus the jnp reference.

    ``fwd(*arrays, **static) -> (out, residuals)`` and ``bwd(residuals, ct) -> cotangents``
    follow the ``numpy_impl`` conventions and pick the implementation from where the inputs
    live: CuPy arrays, or JAX arrays on a GPU when :func:`gpu_available`, go to ``cuda_fwd`` /
    ``cuda_bwd``; everything else to ``numpy_fwd`` / ``numpy_bwd``. Results come back in the
    inputs' array family (NumPy, CuPy or JAX). They are eager only: inside ``jax.jit`` use the
    ``*_jax`` wrappers.
    """

    name: str
    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    numpy_fwd: Callable[..., Any]
    numpy_bwd: Callable[..., Any]
    cuda_fwd: Callable[..., Any]
    cuda_bwd: Callable[..., Any]
    reference: Callable[..., Any]


def _placement(tree: Any) -> str:
    """'cupy', 'jax_gpu', 'jax' or 'numpy': where the array leaves of ``tree`` live."""
    leaves = jax.tree.leaves(tree)
    if any(type(leaf).__module__.split(".")[0] == "cupy" for leaf in leaves):
        return "cupy"
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        raise TypeError("KernelSpec.fwd/bwd are eager; use the *_jax wrappers under jax tracing")
    jax_leaves = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
    if any(_jax_on_gpu(leaf) for leaf in jax_leaves):
        return "jax_gpu"
    return "jax" if jax_leaves else "numpy"


def _dispatching(np_fn: Callable[..., Any], cu_fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **static: Any) -> Any:
        where = _placement(args)
        if where == "cupy" or (where == "jax_gpu" and gpu_available()):
            out = cu_fn(*args, **static)  # JAX GPU inputs cross to CuPy with DLPack
            return out if where == "cupy" else jax.tree.map(to_jax, out)
        if where == "numpy":
            return np_fn(*args, **static)
        out = np_fn(*jax.tree.map(np.asarray, args), **static)
        return jax.tree.map(jnp.asarray, out)

    call.__name__ = np_fn.__name__
    call.__doc__ = f"Dispatching ``{np_fn.__name__}`` (NumPy or CuPy by input placement)."
    return call


def _spec(name: str, ref: Callable[..., Any]) -> KernelSpec:
    np_fwd, np_bwd = getattr(numpy_impl, f"{name}_fwd"), getattr(numpy_impl, f"{name}_bwd")
    cu_fwd, cu_bwd = getattr(cuda_impl, f"{name}_fwd"), getattr(cuda_impl, f"{name}_bwd")
    return KernelSpec(
        name=name,
        fwd=_dispatching(np_fwd, cu_fwd),
        bwd=_dispatching(np_bwd, cu_bwd),
        numpy_fwd=np_fwd,
        numpy_bwd=np_bwd,
        cuda_fwd=cu_fwd,
        cuda_bwd=cu_bwd,
        reference=ref,
    )


KERNELS: dict[str, KernelSpec] = {
    "bias_gelu": _spec("bias_gelu", reference.bias_gelu_ref),
    "softmax_cross_entropy": _spec("softmax_cross_entropy", reference.softmax_cross_entropy_ref),
    "layer_norm": _spec("layer_norm", reference.layer_norm_ref),
}


# --- the kernels as dagdiff layers -------------------------------------------------------
from ..core.custom import CustomLayer, custom_layer  # noqa: E402


#: tanh-approximate GELU of ``x + b``; ``dd.kernels.bias_gelu(x, b)``
bias_gelu: CustomLayer = custom_layer(KERNELS["bias_gelu"].fwd, KERNELS["bias_gelu"].bwd,
                                      name="bias_gelu", jax_fn=bias_gelu_jax)
#: mean softmax cross-entropy of logits [n, V] with integer labels [n]
softmax_cross_entropy: CustomLayer = custom_layer(
    KERNELS["softmax_cross_entropy"].fwd, KERNELS["softmax_cross_entropy"].bwd,
    name="softmax_cross_entropy", jax_fn=softmax_cross_entropy_jax)
#: layer norm over the last axis; ``dd.kernels.layer_norm(x, gamma, beta, eps=1e-5)``
layer_norm: CustomLayer = custom_layer(KERNELS["layer_norm"].fwd, KERNELS["layer_norm"].bwd,
                                       name="layer_norm", jax_fn=layer_norm_jax)

__all__ += ["bias_gelu", "softmax_cross_entropy", "layer_norm"]
