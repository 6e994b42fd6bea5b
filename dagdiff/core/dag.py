"""The one topological sort of task dependencies (pure; used by lowering and planning)."""
from __future__ import annotations

import collections
from typing import Collection, Mapping

from ..errors import CycleError


__all__ = ["topological"]


def topological(deps: Mapping[str, Collection[str]]) -> list[str]:
    """The keys of `deps` (key -> dependencies) with each after its dependencies
    (dependencies outside `deps` are ignored); ties keep the mapping's order. Raises
    `CycleError` when no such order exists."""
    indeg = {k: 0 for k in deps}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for k, ds in deps.items():
        for d in ds:
            if d in indeg:
                indeg[k] += 1
                users[d].append(k)
    ready = collections.deque(k for k, n in indeg.items() if n == 0)
    out = []
    while ready:
        k = ready.popleft()
        out.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(out) < len(indeg):
        raise CycleError(frozenset(k for k, n in indeg.items() if n))
    return out
