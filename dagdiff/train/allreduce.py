"""Data-parallel gradient all-reduce as tasks: a pairwise tree of sums over the replicas,
each sum on a worker of the parameter's stage."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..core.keys import make_key
from ..runtime.tasks import sum_task
from ..runtime.taskspec import Task, TaskRef


__all__ = ["tree_allreduce"]


def tree_allreduce(dsk: dict[str, Any], stage_of: dict[str, int | None],
                   replica_grads: Sequence[Mapping[int, str]], param_nodes: Sequence[int],
                   home: Mapping[int, int | None], p: int, token: str) -> dict[int, str]:
    """Add the sum tasks reducing each parameter's gradient over the replicas (replica r's
    stage s is global stage ``s + r * p``) and return, per parameter node, the key of
    its sum (the caller divides by the replica count): ceil(log2 r) levels of pairs."""
    total: dict[int, str] = {}
    for node in param_nodes:
        keys = [grads.get(node) for grads in replica_grads]
        missing = [r for r, k in enumerate(keys) if k is None]
        if missing:
            raise RuntimeError(f"dagdiff internal error: no gradient of parameter node {node} "
                               f"in replica(s) {missing}")
        stage = home.get(node)
        level = 0
        while len(keys) > 1:
            nxt = []
            for j in range(0, len(keys), 2):
                pair = keys[j:j + 2]
                if len(pair) == 1:
                    nxt.append(pair[0])
                    continue
                k = make_key("reduce", f"p{node}", node, token, None, level * 1000 + j)
                dsk[k] = Task(k, sum_task, (-1, -1), None, None, *map(TaskRef, pair))
                stage_of[k] = None if stage is None else stage + j * p
                nxt.append(k)
            keys, level = nxt, level + 1
        total[node] = keys[0]
    return total
