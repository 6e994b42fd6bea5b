"""The optax update of one stage's parameters, run as a task on the stage's worker, with
its jitted step cached per worker process."""
from __future__ import annotations

import threading
from typing import Any

import jax
import optax

from ..core.byvalue import payload, revive
from ..runtime.memory import sample as sample_memory


__all__ = ["ScaledOptimizer", "update_task"]

# jitted optimizer steps per (trainer, replica count), kept on each worker: the optimizer
# arrives pickled with every task (optax transforms are closures, re-created on each
# unpickling), so a cache keyed by the object would compile on every step
_COMPILED_UPDATES: dict[str, Any] = {}
_UPDATES_LOCK = threading.Lock()


class ScaledOptimizer:
    """An optax transform applied to the replica-summed gradients divided by r; `key`
    names it stably across tasks (the trainer and r) for the workers' jit cache."""

    def __init__(self, optimizer: optax.GradientTransformation, r: int, key: str = "") -> None:
        self.optimizer, self.r, self.key = optimizer, r, key

    def __reduce__(self) -> tuple[Any, ...]:
        # by value, as bytes made once (`core.byvalue`): an optax transform is a set of
        # closures that plain pickle refuses, so each step's whole graph fell back to
        # cloudpickle after a failed plain-pickle attempt
        return (_revive, payload(self, (id(self.optimizer), self.r, self.key),
                                 lambda: (self.optimizer, self.r, self.key)))

    def update(self, grads: Any, state: Any, params: Any) -> Any:
        if self.r > 1:
            grads = [g / self.r for g in grads]
        return self.optimizer.update(grads, state, params)

    def step(self, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, new_state = self.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    def compiled(self) -> Any:
        """The jitted `step`, compiled once per worker process and key."""
        if not self.key:
            return jax.jit(self.step)
        fn = _COMPILED_UPDATES.get(self.key)
        if fn is None:
            with _UPDATES_LOCK:
                fn = _COMPILED_UPDATES.setdefault(self.key, jax.jit(self.step))
        return fn


def _revive(digest: str, data: bytes) -> ScaledOptimizer:
    return revive(digest, data, lambda st: ScaledOptimizer(*st),
                  lambda o: (id(o.optimizer), o.r, o.key))


def update_task(optimizer: ScaledOptimizer, n: int, state: Any, *grads: Any,
                **after: Any) -> tuple:
    """One optax step for one stage's parameter leaves: (new leaves..., new opt state)."""
    params, opt_state = list(state[:n]), state[n]
    new, new_state = optimizer.compiled()(params, opt_state, list(grads))
    out = (*jax.block_until_ready(new), new_state)
    sample_memory()          # old and new state both held: a stage's high point
    return out
