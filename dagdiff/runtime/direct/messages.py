"""What a step's programs tell each other: typed messages, and their form on Dask's wire."""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import numpy as np
from distributed.protocol import to_serialize

from ..tasks import FwdResult, host_view


__all__ = ["Value", "Failure", "End", "Message", "to_wire", "from_wire", "pack", "unpack",
           "INLINE_BYTES"]

#: host arrays up to this size travel inline in the message (dtype, shape and bytes in
#: its msgpack), larger ones and device arrays through Dask's serializers (out of band,
#: the ``cuda`` family for GPU arrays): a small array's Dask serialization costs more
#: than sending it
INLINE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Value:
    """An action's value for `uses` consumer actions on the receiving worker."""

    run: str
    key: str
    uses: int
    value: Any


@dataclasses.dataclass(frozen=True)
class Failure:
    """The action `key` will not produce a value: why (it, or something upstream, failed),
    and the exception that failed, pickled (`cause`: None when it does not pickle, or for
    dagdiff's own dispatch errors), which the receiver raises in turn: the step fails
    with the model's own exception on every worker."""

    run: str
    key: str
    error: str
    cause: bytes | None = None


@dataclasses.dataclass(frozen=True)
class End:
    """The sender's program of the run ended: successfully (error None) or not."""

    run: str
    sender: str
    error: str | None = None
    cause: bytes | None = None            # as `Failure.cause`


Message = Union[Value, Failure, End]
_KINDS: dict[str, type] = {"value": Value, "failure": Failure, "end": End}
_NAMES = {v: k for k, v in _KINDS.items()}


def to_wire(msg: Message) -> dict[str, Any]:
    """A message as distributed sends it: a dict of plain fields; a value goes as packed
    by `pack` (small host arrays inline, other arrays wrapped for Dask's serializers)."""
    out = {"kind": _NAMES[type(msg)]}
    out.update((f.name, getattr(msg, f.name)) for f in dataclasses.fields(msg))
    return out


def from_wire(d: dict[str, Any]) -> Message:
    """The message a `to_wire` dict describes (values unpacked)."""
    kind = _KINDS[d.pop("kind")]
    if kind is Value:
        d["value"] = unpack(d["value"])
    return kind(**d)


def pack(value: Any, leaves: frozenset[int] | None = None) -> dict[str, Any]:
    """What another worker receives of a value: forward results without their pullback,
    only the `leaves` it reads of a tuple or forward result (the others None, so indices
    hold). A host array of a NumPy dtype up to `INLINE_BYTES` travels inline (a
    ``{"t": "nd"}`` record: dtype, shape, bytes); any other array is wrapped in
    `distributed.protocol.to_serialize` so the cluster's serializers send it (out of band;
    a GPU array through the ``cuda`` family where the comm supports it)."""
    def keep(i: int) -> bool:
        return leaves is None or i in leaves

    if isinstance(value, FwdResult):
        return {"t": "fwd", "out": [_leaf(x) if keep(i) else None for i, x in enumerate(value.out)],
                "res": _tree(value.res) if leaves is None else None}
    if isinstance(value, (tuple, list)):
        return {"t": "tuple" if isinstance(value, tuple) else "list",
                "items": [pack(v) if keep(i) else None for i, v in enumerate(value)]}
    leaf = _leaf(value)
    return leaf if _is_inline(leaf) else {"t": "v", "v": leaf}


def unpack(d: Any) -> Any:
    """The value `pack` described (the out-of-band arrays already deserialized by
    distributed, the inline ones rebuilt here)."""
    if d is None:
        return None
    t = d["t"]
    if t == "fwd":
        return FwdResult([_unleaf(x) for x in d["out"]], None, moved=True, res=d["res"])
    if t in ("tuple", "list"):
        items = [unpack(v) for v in d["items"]]
        return tuple(items) if t == "tuple" else items
    if t == "nd":
        return _unleaf(d)
    return d["v"]


def _leaf(x: Any) -> Any:
    # CPU jax arrays as NumPy (no copy, and no JAX reconstruction on the receiver: the
    # consumer's jitted function puts them on its device); GPU arrays stay jax arrays so
    # dagdiff's ``cuda`` serializer can send the device buffer. Only plain arrays of
    # NumPy's own dtypes in native byte order go inline (not masked arrays, not ml_dtypes
    # such as bfloat16 or float8, whose dtype string NumPy cannot read back)
    if x is None:
        return None
    v = host_view(x)
    if (type(v) is np.ndarray and v.nbytes <= INLINE_BYTES and v.dtype.isbuiltin == 1
            and v.dtype.kind in "biufc"):
        return {"t": "nd", "dtype": v.dtype.str, "shape": list(v.shape),
                "data": v.tobytes()}
    return to_serialize(v)


def _is_inline(x: Any) -> bool:
    return isinstance(x, dict) and x.get("t") == "nd"


def _unleaf(x: Any) -> Any:
    """A leaf as `_leaf` sent it: an inline array rebuilt (writeable, its own buffer)."""
    if _is_inline(x):
        return np.frombuffer(bytearray(x["data"]), dtype=np.dtype(x["dtype"])).reshape(
            tuple(x["shape"]))
    return x


def _tree(x: Any) -> Any:
    if x is None:
        return None

    return to_serialize(jax.tree_util.tree_map(host_view, x))
