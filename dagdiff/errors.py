"""Error types raised by dagdiff: built-in subclasses that state the facts and a fix."""
from __future__ import annotations


__all__ = [
    "DagdiffError",
    "LayerShapeError",
    "LayerTypeError",
    "TracerError",
    "KeyFormatError",
    "PlacementError",
    "MicrobatchError",
    "ArgumentError",
    "MemoryLimitError",
    "DirectDispatchError",
    "UpstreamError",
    "CheckpointError",
    "ClientClosedError",
    "ScheduleError",
    "CustomRuleError",
    "CycleError",
    "TrainerError",
    "LostStateError",
    "WorkerLostError",
    "MissingDependencyError",
    "OptimizerError",
]


class DagdiffError(Exception):
    """Base class of every dagdiff error."""


class LayerShapeError(DagdiffError, ValueError):
    """A layer rejected the shapes it was traced with (raised at trace time)."""


class LayerTypeError(DagdiffError, TypeError):
    """A layer rejected the dtypes or argument types it was traced with."""


class TracerError(DagdiffError, TypeError):
    """A traced value was used in a way that needs its data, or outside its trace."""


class KeyFormatError(DagdiffError, ValueError):
    """A string is not a dagdiff task key."""


class PlacementError(DagdiffError, ValueError):
    """A stage, worker or device assignment cannot be satisfied."""


class MicrobatchError(DagdiffError, ValueError):
    """A batch argument cannot be split into the requested microbatches."""


class ArgumentError(DagdiffError, ValueError, TypeError):
    """An argument or option of a dagdiff call is out of range or of the wrong kind (both a
    ValueError and a TypeError, so either ``except`` catches it)."""


class MemoryLimitError(DagdiffError, ValueError):
    """A step's predicted memory on a worker exceeds that worker's memory limit."""


class DirectDispatchError(DagdiffError, RuntimeError):
    """A direct-dispatch step could not go on: an input never came (a worker was lost or
    the step was cancelled), a program ran on a worker it was not built for, or the
    schedule would deadlock."""

    #: the worker a program was built for, when it ran on another one (that worker was
    #: lost and Dask ran the program again on a replacement): recovery's lost worker
    address: str | None = None

    @classmethod
    def built_for_another(cls, address: str, message: str) -> "DirectDispatchError":
        """The error of a program run on a worker other than the one at `address`."""
        error = cls(message)
        error.address = address
        return error


class UpstreamError(DagdiffError, RuntimeError):
    """An input of this task failed on its own worker (the message names the first failure)."""


class CheckpointError(DagdiffError, ValueError):
    """A checkpoint directory is missing, incomplete or not one `dd.save` wrote."""


class ClientClosedError(DagdiffError, RuntimeError):
    """The distributed Client a step would run on was closed."""


class ScheduleError(DagdiffError, ValueError):
    """A pipeline schedule cannot run as asked: bad arguments, an order that misses or
    repeats actions, or one that deadlocks (the message says how to fix it)."""


class CustomRuleError(DagdiffError, ValueError):
    """A custom layer's fwd/bwd rule returned something of the wrong structure, shape or
    dtype: not ``(out, residuals)``, or cotangents that do not match its inputs."""


class CycleError(DagdiffError, ValueError):
    """The dependencies close a cycle; `stuck` holds the keys on or behind it."""

    def __init__(self, stuck: frozenset[str]) -> None:
        self.stuck = stuck
        super().__init__(f"the task graph has a cycle through {', '.join(sorted(stuck)[:4])}")


class TrainerError(DagdiffError, RuntimeError):
    """A `dd.Trainer` was used out of order (e.g. a step before `init`)."""


class LostStateError(TrainerError):
    """Part of a training state was lost with its worker and no replica or copy holds it
    (the message names the stage and how to resume from a checkpoint)."""


class WorkerLostError(TrainerError):
    """A training step failed because a worker it ran on was lost (raised by the step's
    loss, ``loss.result()``); ``state = trainer.recover(state)`` runs it again from a copy
    that survived. `step` is the failed step's number, `workers` the lost addresses."""

    def __init__(self, message: str, step: int | None = None,
                 workers: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.workers = workers

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.step, self.workers)


class OptimizerError(DagdiffError, ValueError):
    """A `dd.Trainer`'s optimizer does not give, applied to each stage's parameters on its
    worker, what it gives applied to the whole model (a global-norm clip reads every
    stage's gradients); the message names the leaf and the way out."""


class MissingDependencyError(DagdiffError, ImportError):
    """A feature needs an optional package that is not installed (the message names the
    pip extra that installs it)."""
