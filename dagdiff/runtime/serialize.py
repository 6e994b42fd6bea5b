"""Teach Dask about JAX arrays: true `sizeof`, wire serialization, content tokens.

Without this, `dask.sizeof` reports a 4 MB jax array as ~700 bytes (wrong spilling,
transfer costs and dashboard bars) and tokenizing falls back to slow pickling.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from dask.sizeof import sizeof
from dask.tokenize import normalize_token

from .internals import deserialize_numpy_ndarray, serialize_numpy_ndarray
from .tasks import FwdResult


__all__ = ["register", "jax_array_type"]

#: every jax array's type is a subclass (dispatch walks the MRO); naming it does not start
#: JAX's backends, so importing dagdiff leaves a worker free to configure them first
jax_array_type: type = jax.Array
_done = False
_lock = threading.Lock()
_tokens: dict[int, tuple[Any, str]] = {}


def _sizeof_jax(x: Any) -> int:
    return int(x.nbytes)


def _sizeof_fwd(r: FwdResult) -> int:
    return r.nbytes() + 64


def _normalize_jax(x: Any) -> tuple[Any, ...]:
    """Content token of a jax array, cached per object (jax arrays are immutable)."""
    ident = id(x)
    hit = _tokens.get(ident)
    if hit is not None and hit[0]() is x:
        return ("jax.Array", hit[1])
    if _is_key(x):      # typed PRNG keys: their data and their implementation's name
        tok: Any = (str(x.dtype), normalize_token(np.asarray(jax.random.key_data(x))))
    else:
        tok = normalize_token(np.asarray(x))
    text = repr(tok)
    try:
        ref = weakref.ref(x, lambda _r, i=ident: _tokens.pop(i, None))
        _tokens[ident] = (ref, text)
    except TypeError:
        pass
    return ("jax.Array", text)


def _is_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (``jax.random.key``): no NumPy view of its own."""
    return bool(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def _serialize_jax(x: Any) -> tuple[dict[str, Any], list[Any]]:
    if _is_key(x):
        header, frames = serialize_numpy_ndarray(np.asarray(jax.random.key_data(x)))
        header["key_impl"] = str(jax.random.key_impl(x))
        return header, frames
    header, frames = serialize_numpy_ndarray(np.asarray(x))
    header["weak_type"] = bool(getattr(x, "weak_type", False))
    return header, frames


def _deserialize_jax(header: dict[str, Any], frames: list[Any]) -> Any:
    arr = deserialize_numpy_ndarray(header, frames)
    impl = header.get("key_impl")
    if impl is not None:
        return jax.random.wrap_key_data(jnp.asarray(arr), impl=impl)
    return jnp.asarray(arr)  # onto this process's default device (its GPU on a GPU worker)


def register() -> None:
    """Register sizeof, tokenize and (if distributed is installed) serializers. Idempotent."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
    sizeof.register(jax_array_type)(_sizeof_jax)
    sizeof.register(FwdResult)(_sizeof_fwd)

    normalize_token.register(jax_array_type)(_normalize_jax)
    try:
        from distributed.protocol import dask_deserialize, dask_serialize
    except ImportError:  # pragma: no cover - distributed is a dependency
        return
    dask_serialize.register(jax_array_type)(_serialize_jax)
    dask_deserialize.register(jax_array_type)(_deserialize_jax)
    from .direct import results     # program results: a stub on the wire

    results.register()
    _register_cuda()


def _register_cuda() -> None:
    """On GPU workers with CuPy: send device buffers of jax arrays through Dask's ``cuda``
    serializer family (used by the UCX comm of distributed-ucxx), via DLPack, no host copy.
    Over TCP, or for CPU arrays, the ``dask`` family above is used instead."""
    try:
        import cupy  # noqa: F401  (only register where CuPy exists)
        from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
    except Exception:
        return

    @cuda_serialize.register(jax_array_type)
    def _ser(x: Any) -> tuple[dict[str, Any], list[Any]]:
        if not any(d.platform == "gpu" for d in x.devices()):
            raise TypeError("not a GPU array")  # distributed then tries the next family
        arr = cupy.from_dlpack(x)
        header, frames = cuda_serialize.dispatch(cupy.ndarray)(arr)
        header["dagdiff-jax"] = True
        return header, frames

    @cuda_deserialize.register(jax_array_type)
    def _deser(header: dict[str, Any], frames: list[Any]) -> Any:
        arr = cuda_deserialize.dispatch(cupy.ndarray)(header, frames)
        return jax.dlpack.from_dlpack(arr)

