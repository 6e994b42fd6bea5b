"""`dd.save` / `dd.load`: training checkpoints (orbax-checkpoint)."""
from __future__ import annotations

import os

import jax
import numpy as np

from ..errors import ArgumentError, CheckpointError
from ..extras import require
from .trainer import Trainer, TrainState


__all__ = ["save", "load"]


def save(path: str | os.PathLike[str], state: TrainState,
         trainer: Trainer | None = None) -> None:
    """Write params, optimizer state and step with orbax-checkpoint (a directory; needs
    the ``checkpoint`` extra)."""
    ocp = require("orbax.checkpoint", "dd.save")
    if not isinstance(state, TrainState):
        swapped = isinstance(path, TrainState)
        raise ArgumentError(
            f"dd.save(path, state) takes a dd.TrainState (from trainer.init, step or fit) "
            f"as its state, got {type(state).__name__}"
            + ("; the arguments are the other way round: dd.save(path, state)" if swapped
               else "; to save a model's parameters, train them with a dd.Trainer, or "
               "save them with orbax or numpy directly"))
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"dd.save(path, state): path must be a str or os.PathLike, got "
                            f"{type(path).__name__}")
    trainer = trainer if trainer is not None else state.trainer
    if state.is_placed:
        if trainer is None:
            raise ArgumentError("dd.save of a placed state needs trainer= to gather it (the "
                                "Trainer that made it no longer exists)")
        params, opts = trainer.gather(state)
        opt_leaves = [jax.tree_util.tree_leaves(o) for o in opts]
    else:
        params, opt_leaves = list(state.params or ()), [list(x) for x in state.opt_leaves or ()]
    tree = {"params": [np.asarray(x) for x in params],
            "opt": [[np.asarray(x) for x in g] for g in opt_leaves],
            "groups": [list(g) for g in state.groups or ()],
            "step": int(state.step)}
    where = os.path.abspath(path)
    _check_target(where)
    ocp.PyTreeCheckpointer().save(where, tree, force=True)


def _check_target(where: str) -> None:
    """Refuse to overwrite what is not a checkpoint: orbax's ``force=True`` (a checkpoint
    saved again to its path) deletes whatever is there first, a file or a directory of
    the user's own."""
    if not os.path.lexists(where):
        return
    if not os.path.isdir(where):
        raise CheckpointError(f"dd.save: {where!r} is a file, not a checkpoint directory; "
                              "give a new path (dd.save writes a directory), or remove it")
    if os.listdir(where) and not os.path.exists(os.path.join(where, "_METADATA")):
        raise CheckpointError(
            f"dd.save: {where!r} is a directory that holds other files than a checkpoint "
            "(saving there would delete them); give a new path, e.g. "
            f"{os.path.join(where, 'checkpoint')!r}")


def load(path: str) -> TrainState:
    """Read a checkpoint written by `save`; the state is placed on the next step."""
    ocp = require("orbax.checkpoint", "dd.load")

    where = os.path.abspath(path)
    if not os.path.isdir(where):
        raise CheckpointError(f"dd.load: no checkpoint directory at {where!r} (dd.save writes "
                              "one); check the path")
    try:
        tree = ocp.PyTreeCheckpointer().restore(where)
        groups = tuple(tuple(int(i) for i in g) for g in tree.get("groups") or ()) or None
        return TrainState(int(tree["step"]), params=tuple(tree["params"]),
                          opt_leaves=tuple(tuple(g) for g in tree.get("opt") or ()) or None,
                          groups=groups)
    except Exception as e:              # noqa: BLE001 - orbax raises many kinds
        raise CheckpointError(
            f"dd.load: {where!r} is not a readable dd.save checkpoint ({type(e).__name__}: "
            f"{str(e)[:200]}); it may be incomplete or corrupt (a save interrupted, files "
            "changed): load an earlier checkpoint, or save again") from e
