"""Objects that travel by value as bytes made once: a layer or an optimizer pickles as its
cloudpickled state, cached on the object, so the graphs of every step pickle with plain
pickle (no cloudpickle fallback for the whole graph) and a process that already revived
the bytes gives back the same object (no function or transform rebuilt per task)."""
from __future__ import annotations

import collections
import functools
import hashlib
import threading
import types
from typing import Any, Callable, Iterable

import numpy as np

import cloudpickle


__all__ = ["payload", "revive", "reads", "portable"]

_REVIVED: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
_LOCK = threading.Lock()
_MAX = 256              # objects kept alive by the cache (most recently used)


def _remember(digest: str, obj: Any) -> None:
    with _LOCK:
        _REVIVED[digest] = obj
        _REVIVED.move_to_end(digest)
        while len(_REVIVED) > _MAX:
            _REVIVED.popitem(last=False)


def payload(obj: Any, ident: Any, state: Callable[[], Any]) -> tuple[str, bytes]:
    """(digest, bytes) of `obj`: `state()` cloudpickled once and cached on the object while
    `ident` (what the bytes depend on) stays the same."""
    cached = obj.__dict__.get("_payload")
    if cached is None or cached[0] != ident:
        data = cloudpickle.dumps(state(), protocol=5)
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        cached = obj.__dict__["_payload"] = (ident, digest, data)
        _remember(digest, obj)
    return cached[1], cached[2]


def revive(digest: str, data: bytes, make: Callable[[Any], Any],
           ident: Callable[[Any], Any]) -> Any:
    """The object pickled as `data`: the one this process already made from these bytes
    (or sent as them), else `make(state)`, remembered with its payload (`ident(obj)`)."""
    with _LOCK:
        hit = _REVIVED.get(digest)
    if hit is not None:
        return hit
    obj = make(cloudpickle.loads(data))
    obj.__dict__["_payload"] = (ident(obj), digest, data)
    _remember(digest, obj)
    return obj


#: values read by value (their repr): what a notebook cell changes between two runs
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
#: a small container or NumPy array is read by its contents, a bigger one by identity
_SMALL = 64
#: functions followed from one layer (its helpers in the same module, their helpers...)
_MAX_FUNCTIONS = 64


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global names `code` and the code nested in it (lambdas, comprehensions) use."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.update(_names(c))
    return tuple(sorted(out))


def _version(v: Any) -> tuple[Any, ...]:
    """What of `v` a change is seen by: its value when it is small and plain, else its
    identity (a new object bound to the name); ("id", ...) entries differ between
    processes."""
    if isinstance(v, _SCALARS):
        return ("v", repr(v))
    if isinstance(v, (tuple, list, frozenset, set)) and len(v) <= _SMALL and all(
            isinstance(x, _SCALARS) for x in v):
        return ("v", type(v).__name__, repr(sorted(v, key=repr) if isinstance(
            v, (set, frozenset)) else v))
    if isinstance(v, dict) and len(v) <= _SMALL and all(
            isinstance(k, _SCALARS) and isinstance(x, _SCALARS) for k, x in v.items()):
        return ("v", "dict", repr(sorted(v.items(), key=repr)))
    if isinstance(v, np.ndarray) and v.size <= _SMALL and v.dtype.kind in "biufc":
        return ("v", "ndarray", str(v.dtype), v.shape, v.tobytes())
    return ("id", type(v).__name__, id(v))


def reads(fns: Iterable[Any]) -> tuple[tuple[str, Any], ...]:
    """What functions read that can change while they stay the same objects: the module
    globals their code names and their closure cells, followed into the functions of the
    same module they call. Cloudpickle takes these by value with a function of a notebook
    or script; a layer's bytes (`payload`) and its compiled form are kept while this is
    the same, so a global changed in a later cell (``SCALE = 3.0``) is seen, as in the
    client's own trace. Mutable objects are seen by content when small and plain (a dict
    of flags), else by identity."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack = [f for f in fns if f is not None]
    while stack and len(seen) < _MAX_FUNCTIONS:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        g = getattr(f, "__globals__", None) or {}
        for name in _names(code):
            if name in g:
                v = g[name]
                out.append((name, _version(v)))
                if isinstance(v, types.FunctionType) and v.__globals__ is g:
                    stack.append(v)
        for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                v = cell.cell_contents
            except ValueError:                 # not bound yet
                continue
            out.append((name, _version(v)))
            if isinstance(v, types.FunctionType):
                stack.append(v)
    return tuple(out)


def portable(read: tuple[tuple[str, Any], ...]) -> str:
    """A digest of what `reads` found that means the same in every process (values, not
    identities): part of a layer's fingerprint, which compiled caches and profiles key
    on; "" when there is none."""
    plain = [(n, v) for n, v in read if v[0] == "v"]
    if not plain:
        return ""
    return hashlib.blake2b(repr(plain).encode(), digest_size=8).hexdigest()
