"""The client process's cyclic garbage collector around steps: paused while a graph is built
(`without_gc`), and the long-lived heap frozen out of it once (`freeze_heap`).

With jax, dask and distributed loaded, a client process tracks ~300,000 objects. Each step
allocates graphs, futures and keys that outlive the young generations, so Python's full
collections come every ~50 tiny steps and take 100-200 ms each (measured on the tiny job:
2.0 ms per step on average, a 120-190 ms stall for the step that pays). On a
`dd.local_cluster` the scheduler shares this process and stalls with it. Freezing what
lives after the first step (the libraries, the traced model, the cluster's client) and
again after the 16th leaves full collections only the objects made since.
Frozen objects are still freed when their last reference goes; only reference cycles
among them are never collected: e.g. an in-process cluster (``processes=False``) or a
client alive at a freeze and closed later keeps its memory for the life of the process
(at most two freezes per process). Dask config ``dagdiff.freeze-heap: false`` turns it off.
"""
from __future__ import annotations

import functools
import gc
import threading
from typing import Any, Callable, TypeVar

import dask


__all__ = ["without_gc", "freeze_heap", "heap_frozen", "FREEZE_AFTER"]

F = TypeVar("F", bound=Callable[..., Any])

_LOCK = threading.Lock()
_FROZEN = False                          # frozen at least once
#: the steps after which the heap is frozen: the first (the libraries, the model) and
#: one more once the first steps' long-lived objects exist (compiled signatures, the
#: cluster's state in the client, step templates)
FREEZE_AFTER = (1, 16)
_built = 0


def without_gc(fn: F) -> F:
    """Pause the cyclic garbage collector while building a graph: building allocates many
    small objects, and collections of a large heap (jax, dask, distributed loaded) cost
    more than the building itself."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run  # type: ignore[return-value]


def freeze_heap(client: Any) -> bool:
    """Count a step built for a distributed `client`; after the `FREEZE_AFTER` ones,
    collect, then `gc.freeze()` every object alive now (see the module's docstring).
    True when this call froze it."""
    global _FROZEN, _built
    if client is None or _built >= FREEZE_AFTER[-1] or not dask.config.get(
            "dagdiff.freeze-heap", True):
        return False
    with _LOCK:
        _built += 1
        if _built not in FREEZE_AFTER:
            return False
        _FROZEN = True
    gc.collect()
    gc.freeze()
    return True


def heap_frozen() -> bool:
    """Whether `freeze_heap` froze this process's heap (at least once)."""
    return _FROZEN
