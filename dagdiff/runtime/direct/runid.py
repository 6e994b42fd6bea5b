"""Run ids without a task: a step's programs learn their run's nonce from the graph itself.

A step's programs must agree on one id per run, and computing the step again must give a
new one, so that messages of two runs never mix. A `RunNonce` sits in every program task
of a step. It has no value of its own: each time the step's graph is pickled (the client
pickles the whole graph once per submission, so every program of the step shares one
pickling) it becomes a fresh `RunId`, a string that travels with the task from then on.
No task, no transfer and no scheduler round trip stand before a program's start (the
``run_`` nonce task this replaces cost one of each: ~5 ms of a tiny step's 45).

A program that Dask runs again with the same task (its step's outputs released and asked
for again while the scheduler still knew the programs) finds the run's id already ended
on its worker; the runtime then counts a new generation of the run (every program of the
step runs again, so every worker counts the same), see `DirectRuntime.run`.

Both tokenize to a constant: the scheduler sees one computation per key however often
the graph is sent, and distributed never warns of a changed ``run_spec``.
"""
from __future__ import annotations

import uuid
from typing import Any


__all__ = ["RunNonce", "RunId", "fresh", "nonce_of"]

_TOKEN = "dagdiff-run-nonce"


def fresh() -> str:
    """A new random run nonce (16 hex digits)."""
    return uuid.uuid4().hex[:16]


class RunId:
    """A run's nonce once the graph was pickled (`str()` gives it; a constant token)."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunId, (self.value,))

    def __dask_tokenize__(self) -> str:
        return _TOKEN

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunId) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"RunId({self.value!r})"


class RunNonce:
    """The nonce of a step's next run: pickles as a fresh `RunId` (pickle's memo gives
    every reference in one pickling the same one). Unpickled in this process (a graph run
    without pickling: an in-process scheduler's own copy) it is its `value`."""

    __slots__ = ("_local",)

    def __init__(self) -> None:
        self._local: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunId, (fresh(),))

    def __dask_tokenize__(self) -> str:
        return _TOKEN

    @property
    def value(self) -> str:
        """The nonce when the task reached its worker without being pickled."""
        if self._local is None:
            self._local = fresh()
        return self._local

    def __repr__(self) -> str:
        return "RunNonce()"


def nonce_of(x: Any) -> str:
    """The run nonce a program task was given (a `RunId`, or an unpickled `RunNonce`)."""
    return x.value if isinstance(x, (RunNonce, RunId)) else str(x)
