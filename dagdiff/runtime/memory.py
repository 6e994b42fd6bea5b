"""Measured memory: the bytes a process holds, sampled at each layer task while a
`dd.record` is open (the measurement `Recording.peak_memory` reports).

A sample is taken when a forward, VJP, sum or accumulate task has its result, while
its inputs are still held: the high point of that task. It counts
- ``device``: the live JAX buffers of this process (`jax.live_arrays`), or, where the
  backend keeps allocator statistics (GPUs), its ``bytes_in_use``;
- ``host``: the NumPy arrays this worker holds in Dask's memory (not what it spilled),
  in its direct-dispatch runs' received values and in its running programs' inputs and
  values (batches and their slices, parameters shipped as NumPy).

Buffers inside one jitted call (XLA's temporaries) are not live arrays; where the
allocator keeps a peak (``peak_bytes_in_use``, GPUs) and it rose while recording, the
closing sample carries it. Sampling costs a walk over the live arrays per task, so it
is on only while a recording is open.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np


__all__ = ["MemorySample", "start", "stop", "sample", "held", "sampling"]


class MemorySample(NamedTuple):
    """Bytes one process held at `time` (its wall clock, seconds)."""

    time: float
    device: int
    host: int

    @property
    def total(self) -> int:
        return self.device + self.host


_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"on": 0, "samples": [], "peak0": None}


def sampling() -> bool:
    """Whether a recording is sampling this process."""
    return bool(_STATE["on"])


def _allocator() -> tuple[int, int] | None:
    """(bytes in use, peak bytes in use) summed over local devices, or None on backends
    without allocator statistics (CPU)."""
    use = peak = 0
    try:
        for d in jax.local_devices():
            stats = d.memory_stats()
            if not stats or "bytes_in_use" not in stats:
                return None
            use += int(stats["bytes_in_use"])
            peak += int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
    except Exception:                          # noqa: BLE001 - backends differ
        return None
    return use, peak


def _device_bytes() -> int:
    alloc = _allocator()
    if alloc is not None:
        return alloc[0]
    total = 0
    live = jax.live_arrays()
    sizes = _SIZES
    for x in live:
        hit = sizes.get(id(x))
        if hit is not None and hit[0]() is x:
            total += hit[1]
            continue
        try:                            # an array's size is read once (~2 us each)
            n = int(x.nbytes)
            sizes[id(x)] = (weakref.ref(x), n)
        except Exception:                      # noqa: BLE001 - freed meanwhile
            continue
        total += n
    if len(sizes) > 2 * len(live) + 64:       # forget arrays that are gone
        for k in [k for k, (ref, _) in sizes.items() if ref() is None]:
            del sizes[k]
    return total


#: id -> (weak reference, bytes) of arrays seen by a sample
_SIZES: dict[int, tuple[Any, int]] = {}


def _walk(value: Any, seen: set[int], depth: int = 0) -> int:
    """NumPy bytes reachable from one held value (containers a few levels deep; a
    buffer shared by views counted once)."""
    if isinstance(value, np.ndarray):
        base = value
        while isinstance(base.base, np.ndarray):
            base = base.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    if depth > 4 or isinstance(value, (str, bytes, int, float, jax.Array)):
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_walk(v, seen, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_walk(v, seen, depth + 1) for v in value.values())
    slots = getattr(type(value), "__slots__", None)
    if slots:                                   # FwdResult, ProgramResult, ...
        return sum(_walk(getattr(value, s, None), seen, depth + 1) for s in slots)
    return 0


def _host_bytes() -> int:
    try:
        from distributed import get_worker
        worker = get_worker()
    except ValueError:                          # not in a worker: nothing held for Dask
        return 0
    seen: set[int] = set()
    total = 0
    data = getattr(worker.data, "fast", worker.data)     # in memory, not the spilled
    for v in list(data.values()):
        total += _walk(v, seen)
    ext = worker.extensions.get("dagdiff")
    for st in list(getattr(ext, "_runs", {}).values()):
        for v in list(st.values.values()):
            total += _walk(v[0], seen)
    for statics, local in list(getattr(ext, "held", {}).values()):
        total += _walk(list(statics.values()), seen)
        total += _walk([v[0] for v in list(local.values())], seen)
    return total


def held() -> MemorySample:
    """What this process holds now."""
    return MemorySample(time.time(), _device_bytes(), _host_bytes())


def sample() -> None:
    """Add a sample when a recording is open (cheap check otherwise)."""
    if not _STATE["on"]:
        return
    s = held()
    with _LOCK:
        if _STATE["on"]:
            _STATE["samples"].append(s)


def start() -> MemorySample:
    """Begin sampling (nested recordings share it); the first sample is the baseline,
    taken after a garbage collection (buffers of earlier steps that only reference
    cycles still hold would otherwise count)."""
    gc.collect()
    first = held()
    with _LOCK:
        if not _STATE["on"]:
            _STATE["samples"] = [first]
            alloc = _allocator()
            _STATE["peak0"] = alloc[1] if alloc else None
        _STATE["on"] += 1
    return first


def stop() -> list[MemorySample]:
    """End sampling; the samples taken since `start` (the last one carries the
    allocator's peak when it rose meanwhile)."""
    last = held()
    with _LOCK:
        _STATE["on"] = max(0, _STATE["on"] - 1)
        samples = list(_STATE["samples"]) + [last]
        alloc, peak0 = _allocator(), _STATE["peak0"]
        if alloc is not None and peak0 is not None and alloc[1] > peak0:
            samples.append(MemorySample(last.time, alloc[1], last.host))
        if not _STATE["on"]:
            _STATE["samples"] = []
    return samples
