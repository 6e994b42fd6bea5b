"""Pure-NumPy forward and backward (VJP) implementations of the hand-written kernels."""

from __future__ import annotations

from typing import Any

import numpy as np


__all__ = [
    "bias_gelu_fwd",
    "bias_gelu_bwd",
    "softmax_cross_entropy_fwd",
    "softmax_cross_entropy_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
]

# Conventions shared by every op here:
#   * ``<op>_fwd(*arrays, **static) -> (out, residuals)``; ``residuals`` is a tuple of plain
#     NumPy arrays (picklable, no closures) and is everything ``<op>_bwd`` needs.
#   * ``<op>_bwd(residuals, ct) -> tuple`` with one cotangent per primal array input, in order;
#     integer inputs (labels) are not differentiable and get ``None`` in their slot.
#   * Floating inputs are promoted to their common dtype. float32 and float64 are computed in
#     that dtype; other floating dtypes (float16, bfloat16) are computed in float32 and the
#     results are cast back. Outputs and cotangents carry the promoted input dtype.

_GELU_C = 0.7978845608028654  # sqrt(2 / pi)
_GELU_A = 0.044715
# Inside the tanh argument z is clamped to +-30; beyond that sigmoid(2u) is exactly 0 or 1 and
# the derivative tail exactly 0 in both float32 and float64, so the clamp changes no result but
# keeps z**3 from overflowing.
_GELU_CLAMP = 30.0


def _float_dtype(*arrays: np.ndarray) -> np.dtype:
    """Common dtype of the floating inputs; raises TypeError for non-floating inputs."""
    dtype = np.result_type(*arrays)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"expected floating-point inputs, got dtype {dtype}")
    return dtype


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """Dtype the arithmetic is done in: float64 stays, everything else uses float32."""
    dtype = np.dtype(dtype)
    return dtype if dtype == np.float64 else np.dtype(np.float32)


def _gelu_and_grad(z: np.ndarray, need_grad: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """tanh-approximation GELU of ``z`` (and its derivative), overflow- and cancellation-free.

    gelu(z) = 0.5 z (1 + tanh(u)) = z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3);
    sigmoid is evaluated from e = exp(-2|u|) <= 1, so nothing overflows.
    """
    one = z.dtype.type(1)
    zc = np.clip(z, -_GELU_CLAMP, _GELU_CLAMP)
    zc2 = zc * zc
    u = z.dtype.type(_GELU_C) * zc * (one + z.dtype.type(_GELU_A) * zc2)
    e = np.exp(-2 * np.abs(u))
    inv = one / (one + e)
    s = np.where(u >= 0, inv, e * inv)
    out = z * s
    if not need_grad:
        return out, None
    du = z.dtype.type(_GELU_C) * (one + z.dtype.type(3 * _GELU_A) * zc2)
    grad = s + 2 * zc * du * (e * inv * inv)
    return out, grad


# ----------------------------------------------------------------------------- bias_gelu


def bias_gelu_fwd(x: Any, b: Any) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """``gelu_tanh(x + b)`` for ``x: [..., d]``, ``b: [d]``; residuals ``(x, b)``."""
    x = np.asarray(x)
    b = np.asarray(b)
    if b.ndim != 1 or x.ndim < 1 or x.shape[-1] != b.shape[0]:
        raise ValueError(f"bias_gelu expects x [..., d] and b [d], got {x.shape} and {b.shape}")
    dtype = _float_dtype(x, b)
    work = _work_dtype(dtype)
    x = x.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    out, _ = _gelu_and_grad(x.astype(work, copy=False) + b.astype(work, copy=False), False)
    return out.astype(dtype, copy=False), (x, b)


def bias_gelu_bwd(
    res: tuple[np.ndarray, np.ndarray], ct: Any
) -> tuple[np.ndarray, np.ndarray]:
    """VJP of :func:`bias_gelu_fwd`: ``(dx, db)`` with ``db = dx`` summed over leading axes."""
    x, b = (np.asarray(r) for r in res)
    dtype = x.dtype
    work = _work_dtype(dtype)
    _, grad = _gelu_and_grad(x.astype(work, copy=False) + b.astype(work, copy=False), True)
    assert grad is not None
    dx = np.asarray(ct).astype(work) * grad
    db = dx.reshape(-1, b.shape[0]).sum(axis=0)
    return dx.astype(dtype, copy=False), db.astype(dtype, copy=False)


# ----------------------------------------------------------------- softmax_cross_entropy


def _check_labels(labels: np.ndarray, n: int, num_classes: int) -> None:
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
    if n and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")


def softmax_cross_entropy_fwd(
    logits: Any, labels: Any
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Mean softmax cross-entropy of ``logits: [n, V]`` against integer ``labels: [n]``.

    Returns a 0-d array and residuals ``(logits, labels, row_max, row_lse)`` where
    ``row_lse = log(sum(exp(logits - row_max)))``; both are ``[n]`` arrays of the working dtype.
    """
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, V], got shape {logits.shape}")
    n, num_classes = logits.shape
    _check_labels(labels, n, num_classes)
    dtype = _float_dtype(logits)
    work = _work_dtype(dtype)
    lw = logits.astype(work, copy=False)
    row_max = lw.max(axis=1)
    shifted = lw - row_max[:, None]
    row_lse = np.log(np.exp(shifted).sum(axis=1))
    picked = np.take_along_axis(shifted, labels[:, None].astype(np.intp), axis=1)[:, 0]
    loss = (row_lse - picked).mean(dtype=work) if n else work.type(np.nan)
    return np.asarray(loss, dtype=dtype), (logits, labels, row_max, row_lse)


def softmax_cross_entropy_bwd(
    res: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ct: Any
) -> tuple[np.ndarray, None]:
    """VJP of :func:`softmax_cross_entropy_fwd`: ``(dlogits, None)``.

    ``dlogits = (softmax(logits) - onehot(labels)) * ct / n``. The second slot is ``None``
    because integer labels have no cotangent.
    """
    logits, labels, row_max, row_lse = (np.asarray(r) for r in res)
    dtype = logits.dtype
    work = _work_dtype(dtype)
    n = logits.shape[0]
    probs = np.exp((logits.astype(work) - row_max[:, None]) - row_lse[:, None])
    probs[np.arange(n), labels.astype(np.intp)] -= work.type(1)
    probs *= np.asarray(ct, dtype=work) / work.type(max(n, 1))
    return probs.astype(dtype, copy=False), None


# ---------------------------------------------------------------------------- layer_norm


def layer_norm_fwd(
    x: Any, gamma: Any, beta: Any, eps: float = 1e-5
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Layer norm of ``x: [..., d]`` over the last axis, then ``* gamma + beta``.

    Returns ``y`` (shape of ``x``) and residuals ``(x, gamma, mean, rstd)``; ``mean`` and
    ``rstd = 1 / sqrt(var + eps)`` have shape ``x.shape[:-1]`` and the working dtype. The
    variance is computed in two passes, so zero-variance and large-offset rows stay accurate.
    """
    x = np.asarray(x)
    gamma = np.asarray(gamma)
    beta = np.asarray(beta)
    if x.ndim < 1 or gamma.shape != (x.shape[-1],) or beta.shape != (x.shape[-1],):
        raise ValueError(
            f"layer_norm expects x [..., d], gamma [d], beta [d]; got {x.shape}, "
            f"{gamma.shape}, {beta.shape}"
        )
    dtype = _float_dtype(x, gamma, beta)
    work = _work_dtype(dtype)
    x = x.astype(dtype, copy=False)
    gamma = gamma.astype(dtype, copy=False)
    beta = beta.astype(dtype, copy=False)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).astype(work, copy=False)
    mean = x2.mean(axis=1, dtype=work)
    xc = x2 - mean[:, None]
    var = (xc * xc).mean(axis=1, dtype=work)
    rstd = work.type(1) / np.sqrt(var + work.type(eps))
    y = xc * rstd[:, None] * gamma.astype(work) + beta.astype(work)
    lead = x.shape[:-1]
    return (
        y.reshape(x.shape).astype(dtype, copy=False),
        (x, gamma, mean.reshape(lead), rstd.reshape(lead)),
    )


def layer_norm_bwd(
    res: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ct: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """VJP of :func:`layer_norm_fwd`: ``(dx, dgamma, dbeta)``."""
    x, gamma, mean, rstd = (np.asarray(r) for r in res)
    dtype = x.dtype
    work = _work_dtype(dtype)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).astype(work, copy=False)
    dy = np.asarray(ct).reshape(-1, d).astype(work, copy=False)
    mean = mean.reshape(-1, 1).astype(work, copy=False)
    rstd = rstd.reshape(-1, 1).astype(work, copy=False)
    xhat = (x2 - mean) * rstd
    g = dy * gamma.astype(work)
    dx = rstd * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    dgamma = (dy * xhat).sum(axis=0)
    dbeta = dy.sum(axis=0)
    return (
        dx.reshape(x.shape).astype(dtype, copy=False),
        dgamma.astype(dtype, copy=False),
        dbeta.astype(dtype, copy=False),
    )
