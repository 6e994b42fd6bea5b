"""Training on the workers: dd.Trainer (state on the stage workers, all-reduce, optax updates)
and checkpoints."""
from __future__ import annotations


__all__: list[str] = []
