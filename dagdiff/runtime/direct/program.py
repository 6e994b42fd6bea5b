"""The program of one worker in one step: its actions in run order (the plan's
`PlannedAction`s bound to their tasks and addresses), the step's inputs it reads and its
peers (a frozen record, built by `graph.rewrite` from the pure `plan`, run by
`run.ProgramRun`)."""
from __future__ import annotations

import dataclasses

from .plan import PlannedAction


__all__ = ["Program"]


@dataclasses.dataclass(frozen=True)
class Program:
    """A worker's part of one step: its actions in run order."""

    key: str
    step: str                               # token shared by the step's programs
    where: str                              # worker slot (or address)
    address: str                            # the worker it was built for
    actions: tuple[PlannedAction, ...]     # each bound to its task
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
