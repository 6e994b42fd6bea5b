"""Counters users and tests read: pullbacks rematerialized, layer signatures compiled."""
from __future__ import annotations

from typing import Any

from ..cluster.info import current_client
from ..runtime import compiled as tasks


__all__ = ["remat_count", "reset_remat_count", "compile_counts", "peak_live",
           "reset_peak_live"]


def _client(client: Any) -> Any:
    return client if client is not None else current_client()


def remat_count(client: Any = None) -> int:
    """Pullbacks rebuilt because they left the process of their forward task.

    Sums this process and, with a distributed client (given or default), every worker.
    Ordinary runs keep it at 0; `remat=True` layers recompute on purpose and do not count.
    """
    total = tasks.remat_count()
    c = _client(client)
    if c is not None:
        total += sum(c.run(tasks.remat_count).values())
    return total


def reset_remat_count(client: Any = None) -> None:
    """Set the remat counters of this process (and of the client's workers) to 0."""
    tasks.reset_remat_count()
    c = _client(client)
    if c is not None:
        c.run(tasks.reset_remat_count)


def compile_counts(client: Any = None) -> dict[str, int]:
    """Layer signatures compiled per process ('local' and each worker address): one per
    layer, argument layout and shapes, so a batch of a new shape (a new sequence
    length) adds one per layer it reaches, and a shape seen before adds none. Each
    process keeps the most recently used `dagdiff.compiled-signatures` (default 1024)."""
    out = {"local": tasks.compile_count()}
    c = _client(client)
    if c is not None:
        out.update(c.run(tasks.compile_count))
    return out


def peak_live(client: Any = None) -> dict[Any, int]:
    """Per stage: the most microbatches whose pullbacks were alive at once (max over this
    process and, with a client, every worker). 1F1B keeps it at p - s on stage s of p;
    GPipe lets it reach the number of microbatches."""
    out = dict(tasks.peak_live())
    c = _client(client)
    if c is not None:
        for per in c.run(tasks.peak_live).values():
            for s, n in per.items():
                out[s] = max(out.get(s, 0), n)
    return out


def reset_peak_live(client: Any = None) -> None:
    """Forget the peaks recorded so far (this process and the client's workers)."""
    tasks.reset_peak_live()
    c = _client(client)
    if c is not None:
        c.run(tasks.reset_peak_live)
