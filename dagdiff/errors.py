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
    "DirectDispatchError",
    "UpstreamError",
    "CheckpointError",
    "ClientClosedError",
    "ScheduleError",
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


class ArgumentError(DagdiffError, ValueError):
    """An argument or option of a dagdiff call is out of range or of the wrong kind."""


class DirectDispatchError(DagdiffError, RuntimeError):
    """A direct-dispatch step could not go on: an input never came (a worker was lost or
    the step was cancelled), a program ran on a worker it was not built for, or the
    schedule would deadlock."""


class UpstreamError(DagdiffError, RuntimeError):
    """An input of this task failed on its own worker (the message names the first failure)."""


class CheckpointError(DagdiffError, ValueError):
    """A checkpoint directory is missing, incomplete or not one `dd.save` wrote."""


class ClientClosedError(DagdiffError, RuntimeError):
    """The distributed Client a step would run on was closed."""


class ScheduleError(DagdiffError, ValueError):
    """A pipeline schedule cannot run as asked: bad arguments, an order that misses or
    repeats actions, or one that deadlocks (the message says how to fix it)."""
