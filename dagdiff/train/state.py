"""`TrainState`: where training stands (a frozen record), and the tokens that name a step's
inputs in its keys."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import jax
from dask.base import tokenize

from .recovery import Lineage

if TYPE_CHECKING:
    from .trainer import Trainer


__all__ = ["TrainState", "state_identity", "batch_token", "NOT_INITIALIZED"]

#: what a Trainer that `init` never saw says when asked to step
NOT_INITIALIZED = (
    "this Trainer has not seen the model's parameters yet: call trainer.init(params) "
    "before trainer.step or trainer.fit (a state from dd.load holds the parameters' "
    "leaves, not their structure: call trainer.init with parameters of the model's "
    "structure, e.g. the initial ones, then trainer.fit(batches, state=loaded))")


@dataclass(frozen=True)
class TrainState:
    """Where training stands: the step count and, per (replica, group), the stage's
    parameters + optimizer state - a Future on its worker once placed, or concrete
    leaves (after `Trainer.init` without a batch, or `dd.load`) to be placed on the
    next step. `groups` lists the parameter-leaf indices of each group (stage)."""

    step: int
    params: tuple[Any, ...] | None = None            # concrete leaves (unplaced)
    opt_leaves: tuple[tuple[Any, ...], ...] | None = None  # concrete, per group (unplaced)
    groups: tuple[tuple[int, ...], ...] | None = None
    placed: Mapping[tuple[int, int], Any] | None = None  # (replica, group) -> Future/tuple
    owner: Any = dataclasses.field(default=None, repr=False, compare=False)  # weakref
    #: a second copy of each placed value, for recovery: a Future on another worker, or
    #: the concrete value (the initial state, kept on the client)
    backup: Mapping[tuple[int, int], Any] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    #: the worker address each placed value was made on
    where: Mapping[tuple[int, int], str] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    #: how to make this state again after a lost worker (`Trainer.recover`)
    lineage: Lineage | None = dataclasses.field(default=None, repr=False, compare=False)
    #: the loss of the step that made this state (a `StepLoss` Future on a cluster)
    loss: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: made inside a window of steps (`Trainer.fit(window=)`): `placed` names values the
    #: window's next program reads in place, which no client holds (nothing to restore
    #: from or copy; only the window's last state is a usual one)
    in_window: bool = dataclasses.field(default=False, repr=False, compare=False)
    #: the parameters' structure and shapes of the model the state was made for (its
    #: trainer's `init`; None for a loaded checkpoint until it is placed)
    signature: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def trainer(self) -> "Trainer | None":
        """The Trainer that made this state (if it still exists)."""
        return self.owner() if self.owner is not None else None

    @property
    def is_placed(self) -> bool:
        return self.placed is not None


def state_identity(state: TrainState) -> Any:
    """The Dask keys of a placed state's values (or the values, on the local scheduler)."""
    out = []
    for rg, v in sorted((state.placed or {}).items()):
        key = getattr(v, "key", None)
        out.append((rg, key if key is not None else batch_token([v])))
    return tuple(out)


def batch_token(batch: Any) -> str:
    """A content token of a step's batch (cached per jax array by dagdiff's tokenizer)."""
    return tokenize(*jax.tree_util.tree_leaves(batch), ensure_deterministic=False)
