"""CuPy implementations of the hand-written kernels, compiled at run time from ``kernels/*.cu``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax.dlpack
import numpy as np


if TYPE_CHECKING:  # pragma: no cover - typing only; cupy is imported lazily at run time
    import cupy

__all__ = [
    "gpu_available",
    "to_cupy",
    "to_jax",
    "bias_gelu_fwd",
    "bias_gelu_bwd",
    "softmax_cross_entropy_fwd",
    "softmax_cross_entropy_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
]

# Same conventions as ``numpy_impl``: ``<op>_fwd(...) -> (out, residuals)`` and
# ``<op>_bwd(residuals, ct) -> cotangents``, with identical residual layouts (so residuals from
# either implementation can be fed to the other's backward after moving them across devices).
# Inputs may be CuPy arrays, JAX arrays (moved with DLPack, zero-copy on the same GPU) or
# anything ``cupy.asarray`` accepts; outputs and residuals are CuPy arrays. float32 and float64
# use the matching ``_f32`` / ``_f64`` kernels; other floating dtypes run in float32 and are cast
# back.

_ROW_BLOCK_MAX = 512  # threads per block for the one-block-per-row kernels
_ELEMWISE_BLOCK = 256
_COLUMN_BLOCK = 256
_MAX_GRID = 65535
_MAX_CHUNKS = 256  # row chunks for the column partial-sum kernels (grid.y)


# ----------------------------------------------------------------------------- plumbing


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible; never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # ImportError, CUDARuntimeError (no driver), ...
        return False


_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def to_cupy(x: Any) -> cupy.ndarray:
    """Move ``x`` to a CuPy array.

    Arrays already on a CUDA device (JAX GPU arrays, torch tensors, ...) cross zero-copy through
    DLPack; host arrays (NumPy, JAX CPU arrays, scalars) are copied with ``cupy.asarray``.
    """
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            on_cuda = int(x.__dlpack_device__()[0]) in _DLPACK_CUDA_DEVICES
        except Exception:
            on_cuda = False
        if on_cuda:
            return cupy.from_dlpack(x)
    return cupy.asarray(np.asarray(x))


def to_jax(x: Any) -> Any:
    """Wrap a CuPy array as a JAX array through DLPack (zero-copy on the same GPU)."""
    return jax.dlpack.from_dlpack(x)


def _kernel_source(name: str) -> str:
    """Source text of ``kernels/<name>``: package data ``dagdiff/kernels_cu`` or the repo copy."""
    try:
        from importlib import resources

        resource = resources.files("dagdiff").joinpath("kernels_cu").joinpath(name)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except Exception:  # dagdiff not importable as a package, no such data, odd loaders
        pass
    path = Path(__file__).resolve().parents[2] / "kernels" / name
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"CUDA source {name!r} not found as dagdiff package data 'kernels_cu/{name}' "
            f"nor at {path}"
        ) from None


_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


@functools.lru_cache(maxsize=None)
def _module(file: str, dtype_tag: str) -> Any:
    """Compiled ``cupy.RawModule`` for ``file``, cached per (file, dtype).

    Each ``.cu`` holds both the ``_f32`` and ``_f64`` kernels; CuPy's own compile cache (keyed
    on the source and options) means the two dtype entries share one NVRTC compilation.
    """
    import cupy

    del dtype_tag  # part of the cache key only
    return cupy.RawModule(code=_kernel_source(file), options=("--std=c++14",))


def _kernel(file: str, base: str, dtype: np.dtype) -> Any:
    tag = _SUFFIX[np.dtype(dtype)]
    return _module(file, tag).get_function(f"{base}_{tag}")


def _float_dtypes(*arrays: Any) -> tuple[np.dtype, np.dtype]:
    """(promoted dtype, kernel dtype) for floating inputs."""
    dtype = np.result_type(*(np.dtype(a.dtype) for a in arrays))
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"expected floating-point inputs, got dtype {dtype}")
    return dtype, (dtype if dtype == np.float64 else np.dtype(np.float32))


def _contig(x: cupy.ndarray, dtype: np.dtype) -> cupy.ndarray:
    import cupy

    return cupy.ascontiguousarray(x, dtype=dtype)


def _row_block(width: int) -> int:
    """Threads per block for one-block-per-row kernels: a multiple of 32 covering the row."""
    warps = min(max((width + 31) // 32, 1), _ROW_BLOCK_MAX // 32)
    return 32 * warps


def _chunks(n: int) -> tuple[int, int]:
    """(number of row chunks, rows per chunk) for the column partial-sum kernels."""
    num = max(1, min(n, _MAX_CHUNKS))
    per = max(1, -(-n // num))
    return -(-max(n, 1) // per), per


_i64 = np.int64


# ----------------------------------------------------------------------------- bias_gelu


def bias_gelu_fwd(x: Any, b: Any) -> tuple[cupy.ndarray, tuple[cupy.ndarray, cupy.ndarray]]:
    """``gelu_tanh(x + b)`` for ``x: [..., d]``, ``b: [d]``; residuals ``(x, b)``."""
    import cupy

    x, b = to_cupy(x), to_cupy(b)
    if b.ndim != 1 or x.ndim < 1 or x.shape[-1] != b.shape[0]:
        raise ValueError(f"bias_gelu expects x [..., d] and b [d], got {x.shape} and {b.shape}")
    dtype, work = _float_dtypes(x, b)
    x, b = x.astype(dtype, copy=False), b.astype(dtype, copy=False)
    xw, bw = _contig(x, work), _contig(b, work)
    out = cupy.empty(x.shape, dtype=work)
    total, d = int(x.size), int(b.shape[0])
    if total:
        grid = min(-(-total // _ELEMWISE_BLOCK), _MAX_GRID)
        _kernel("bias_gelu.cu", "bias_gelu_fwd", work)(
            (grid,), (_ELEMWISE_BLOCK,), (xw, bw, out, _i64(total), _i64(d))
        )
    return out.astype(dtype, copy=False), (x, b)


def bias_gelu_bwd(
    res: tuple[Any, Any], ct: Any
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """VJP of :func:`bias_gelu_fwd`: ``(dx, db)``; ``db`` is reduced over rows on the GPU."""
    import cupy

    x, b = (to_cupy(r) for r in res)
    dtype, work = _float_dtypes(x, b)
    xw, bw, ctw = _contig(x, work), _contig(b, work), _contig(to_cupy(ct), work)
    if ctw.shape != x.shape:
        raise ValueError(f"cotangent shape {ctw.shape} does not match x {x.shape}")
    total, d = int(x.size), int(b.shape[0])
    n = total // d if d else 0
    dx = cupy.empty(x.shape, dtype=work)
    if total:
        grid = min(-(-total // _ELEMWISE_BLOCK), _MAX_GRID)
        _kernel("bias_gelu.cu", "bias_gelu_bwd", work)(
            (grid,), (_ELEMWISE_BLOCK,), (xw, bw, ctw, dx, _i64(total), _i64(d))
        )
        num, per = _chunks(n)
        partial = cupy.empty((num, d), dtype=work)
        _kernel("bias_gelu.cu", "bias_gelu_dbias", work)(
            (-(-d // _COLUMN_BLOCK), num),
            (_COLUMN_BLOCK,),
            (dx, partial, _i64(n), _i64(d), _i64(per)),
        )
        db = partial.sum(axis=0)
    else:
        db = cupy.zeros((d,), dtype=work)
    return dx.astype(dtype, copy=False), db.astype(dtype, copy=False)


# ----------------------------------------------------------------- softmax_cross_entropy


def softmax_cross_entropy_fwd(
    logits: Any, labels: Any
) -> tuple[cupy.ndarray, tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray, cupy.ndarray]]:
    """Mean softmax cross-entropy; residuals ``(logits, labels, row_max, row_lse)``.

    Out-of-range labels are not checked on the host (that would synchronise); they make the
    loss NaN.
    """
    import cupy

    logits, labels = to_cupy(logits), to_cupy(labels)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, V], got shape {logits.shape}")
    n, num_classes = (int(s) for s in logits.shape)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
    dtype, work = _float_dtypes(logits)
    lw = _contig(logits, work)
    lab = _contig(labels, np.dtype(np.int64))
    row_loss = cupy.empty((n,), dtype=work)
    row_max = cupy.empty((n,), dtype=work)
    row_lse = cupy.empty((n,), dtype=work)
    if n and num_classes:
        _kernel("softmax_cross_entropy.cu", "softmax_xent_fwd", work)(
            (min(n, _MAX_GRID),),
            (_row_block(num_classes),),
            (lw, lab, row_loss, row_max, row_lse, _i64(n), _i64(num_classes)),
        )
    loss = row_loss.mean() if n else cupy.asarray(np.nan, dtype=work)
    return loss.astype(dtype, copy=False), (logits, labels, row_max, row_lse)


def softmax_cross_entropy_bwd(
    res: tuple[Any, Any, Any, Any], ct: Any
) -> tuple[cupy.ndarray, None]:
    """VJP: ``(dlogits, None)`` -- integer labels get no cotangent."""
    import cupy

    logits, labels, row_max, row_lse = (to_cupy(r) for r in res)
    dtype, work = _float_dtypes(logits)
    n, num_classes = (int(s) for s in logits.shape)
    lw = _contig(logits, work)
    lab = _contig(labels, np.dtype(np.int64))
    ctw = _contig(to_cupy(ct), work).reshape(1)
    dlogits = cupy.empty((n, num_classes), dtype=work)
    if n and num_classes:
        _kernel("softmax_cross_entropy.cu", "softmax_xent_bwd", work)(
            (min(n, _MAX_GRID),),
            (_row_block(num_classes),),
            (
                lw,
                lab,
                _contig(row_max, work),
                _contig(row_lse, work),
                ctw,
                dlogits,
                _i64(n),
                _i64(num_classes),
            ),
        )
    return dlogits.astype(dtype, copy=False), None


# ---------------------------------------------------------------------------- layer_norm


def layer_norm_fwd(
    x: Any, gamma: Any, beta: Any, eps: float = 1e-5
) -> tuple[cupy.ndarray, tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray, cupy.ndarray]]:
    """Layer norm over the last axis; residuals ``(x, gamma, mean, rstd)`` (``[...]`` rows)."""
    import cupy

    x, gamma, beta = to_cupy(x), to_cupy(gamma), to_cupy(beta)
    if x.ndim < 1 or gamma.shape != (x.shape[-1],) or beta.shape != (x.shape[-1],):
        raise ValueError(
            f"layer_norm expects x [..., d], gamma [d], beta [d]; got {x.shape}, "
            f"{gamma.shape}, {beta.shape}"
        )
    dtype, work = _float_dtypes(x, gamma, beta)
    x = x.astype(dtype, copy=False)
    gamma, beta = gamma.astype(dtype, copy=False), beta.astype(dtype, copy=False)
    d = int(x.shape[-1])
    lead = tuple(x.shape[:-1])
    n = int(np.prod(lead, dtype=np.int64))
    xw = _contig(x, work)
    y = cupy.empty(x.shape, dtype=work)
    mean = cupy.empty(lead, dtype=work)
    rstd = cupy.empty(lead, dtype=work)
    if n and d:
        _kernel("layer_norm.cu", "layer_norm_fwd", work)(
            (min(n, _MAX_GRID),),
            (_row_block(d),),
            (
                xw,
                _contig(gamma, work),
                _contig(beta, work),
                y,
                mean,
                rstd,
                _i64(n),
                _i64(d),
                work.type(eps),
            ),
        )
    return y.astype(dtype, copy=False), (x, gamma, mean, rstd)


def layer_norm_bwd(
    res: tuple[Any, Any, Any, Any], ct: Any
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """VJP of :func:`layer_norm_fwd`: ``(dx, dgamma, dbeta)``."""
    import cupy

    x, gamma, mean, rstd = (to_cupy(r) for r in res)
    dtype, work = _float_dtypes(x, gamma)
    d = int(x.shape[-1])
    n = int(x.size) // d if d else 0
    xw = _contig(x, work)
    dy = _contig(to_cupy(ct), work)
    if dy.shape != x.shape:
        raise ValueError(f"cotangent shape {dy.shape} does not match x {x.shape}")
    mw, rw = _contig(mean, work), _contig(rstd, work)
    dx = cupy.empty(x.shape, dtype=work)
    if n and d:
        _kernel("layer_norm.cu", "layer_norm_bwd", work)(
            (min(n, _MAX_GRID),),
            (_row_block(d),),
            (xw, _contig(gamma, work), mw, rw, dy, dx, _i64(n), _i64(d)),
        )
        num, per = _chunks(n)
        dgamma_part = cupy.empty((num, d), dtype=work)
        dbeta_part = cupy.empty((num, d), dtype=work)
        _kernel("layer_norm.cu", "layer_norm_bwd_params", work)(
            (-(-d // _COLUMN_BLOCK), num),
            (_COLUMN_BLOCK,),
            (xw, mw, rw, dy, dgamma_part, dbeta_part, _i64(n), _i64(d), _i64(per)),
        )
        dgamma, dbeta = dgamma_part.sum(axis=0), dbeta_part.sum(axis=0)
    else:
        dgamma = cupy.zeros((d,), dtype=work)
        dbeta = cupy.zeros((d,), dtype=work)
    return (
        dx.astype(dtype, copy=False),
        dgamma.astype(dtype, copy=False),
        dbeta.astype(dtype, copy=False),
    )
