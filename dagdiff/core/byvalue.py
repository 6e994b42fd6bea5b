"""Objects that travel by value as bytes made once: a layer or an optimizer pickles as its
cloudpickled state, cached on the object, so the graphs of every step pickle with plain
pickle (no cloudpickle fallback for the whole graph) and a process that already revived
the bytes gives back the same object (no function or transform rebuilt per task)."""
from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any, Callable

import cloudpickle


__all__ = ["payload", "revive"]

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
