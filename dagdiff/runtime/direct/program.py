"""The program of one worker in one step: its actions in run order, where each action's
inputs come from and where its value goes (frozen records, built by `graph.rewrite`
from the pure `plan`, run by `runtime.DirectRuntime`)."""
from __future__ import annotations

import dataclasses

from ..taskspec import Task


__all__ = ["Remote", "Action", "Program"]


@dataclasses.dataclass(frozen=True)
class Remote:
    """Consumers of an action's value on another worker."""

    where: str                              # the worker's slot (or address)
    address: str                            # its Dask address
    uses: int                               # consumer actions there
    leaves: frozenset[int] | None = None    # the leaves they read (None: all)


@dataclasses.dataclass(frozen=True)
class Action:
    """One task of a program: the Dask task (ordering-only edges dropped), where its
    inputs come from, and where its value goes."""

    key: str
    task: Task
    inputs: tuple[tuple[str, str], ...]     # (producer key, producer's worker)
    local: int                              # consumer actions on this worker
    remote: tuple[Remote, ...]              # consumers on other workers
    export: bool                            # an ordinary task (an output) reads it


@dataclasses.dataclass(frozen=True)
class Program:
    """A worker's part of one step: its actions in run order."""

    key: str
    step: str                               # token shared by the step's programs
    where: str                              # worker slot (or address)
    address: str                            # the worker it was built for
    actions: tuple[Action, ...]
    statics: tuple[str, ...]                # keys of the step's inputs, in argument order
    timeout: float
    #: (where, address) of the step's other programs (the closing exchange, probes)
    members: tuple[tuple[str, str], ...] = ()
    #: report each finished action to the scheduler, for the dashboard (`dagdiff.runtime.live`)
    live: bool = False

    def address_of(self, where: str) -> str:
        for w, address in self.members:
            if w == where:
                return address
        return where
