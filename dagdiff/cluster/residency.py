"""Parameters that stay on their stage's worker across calls (scattered once)."""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import jax
import numpy as np
from dask.base import tokenize

from .targets import Targets


__all__ = ["resident_inputs"]


_RESIDENT: "weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, Any, Any, Any]]]" = \
    weakref.WeakKeyDictionary()


def resident_inputs(trace: Any, client: Any, targets: Targets, home: Mapping[int, int | None],
                    kinds: tuple[str, ...] = ("param",)) -> dict[int, tuple[Any, int]]:
    """Scatter input values of the given node kinds to the worker of their stage once, and
    reuse the Future while the same array object is alive, its future still valid and
    its stage still on that worker (a new placement scatters it to the new worker, and
    the old copy goes with its last reference: no stale copy held, nothing fetched
    from the old worker every step).

    Returns {node index: (Future, -1)} for `lower(inputs=...)`."""
    cache = _RESIDENT.setdefault(client, {})
    out: dict[int, tuple[Any, int]] = {}
    todo: list[tuple[int, Any, list[str] | None, Any]] = []
    for n in trace.nodes:
        if n.kind not in kinds or not isinstance(n.value, (jax.Array, np.ndarray)):
            continue
        hit = cache.get(id(n.value))
        stamp = None if isinstance(n.value, jax.Array) else _np_stamp(n.value)
        addr = targets.address(home.get(n.index))
        if (hit is not None and hit[0]() is n.value and hit[2] == stamp
                and hit[3] == addr and hit[1].status == "finished"):
            out[n.index] = (hit[1], -1)
            continue
        todo.append((n.index, n.value, addr, stamp))
    for idx, value, addr, stamp in todo:
        fut = client.scatter(value, workers=[addr] if addr is not None else None, hash=False)
        try:
            ref = weakref.ref(value)
        except TypeError:
            out[idx] = (fut, -1)
            continue
        ident = id(value)
        cache[ident] = (ref, fut, stamp, addr)
        weakref.finalize(value, cache.pop, ident, None)
        out[idx] = (fut, -1)
    return out


def _np_stamp(a: Any) -> str:
    return tokenize(a)
