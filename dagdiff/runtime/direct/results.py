"""What a program task returns: the values its step's outputs read, kept on its worker.

A step's outputs (the loss, each gradient leaf) are ordinary Dask tasks on the worker of
the program that computed their values, and each waits for every program of the step
(computing any output runs the whole step). They read their own program's result in
place; another worker's program result is a dependency for order alone, so on Dask's
wire (a comm with a recipient) a `ProgramResult` travels as an empty stub: no values
move, and no completion task per program is needed. Spilled to disk, pickled, or sent
by a comm that gives no recipient, it keeps its values.
"""
from __future__ import annotations

from typing import Any

from ...errors import DirectDispatchError


__all__ = ["ProgramResult", "Export", "LocalImport", "register"]


class ProgramResult(dict):  # type: ignore[type-arg]
    """The exports of one program run: action key -> value (a dict), plus the program's
    key. `stub`: a copy sent to another worker, which holds no values."""

    __slots__ = ("program", "stub")

    def __init__(self, program: str, values: dict[str, Any] | None = None,
                 stub: bool = False) -> None:
        super().__init__(values or {})
        self.program = program
        self.stub = stub

    def value(self, key: str) -> Any:
        """The exported value of action `key` (a clear error on a stub)."""
        if self.stub:
            raise DirectDispatchError(
                f"the value of {key} stays on the worker of {self.program}, but a task on "
                "another worker read it: that worker was lost (or restarted) after the "
                "program ended, and only a stub of its result is left elsewhere. Compute the "
                "step again (Trainer.fit does, from the state before it).")
        try:
            return self[key]
        except KeyError:
            raise DirectDispatchError(
                f"{self.program} exported no value {key} (exports: "
                f"{', '.join(sorted(self)[:8])}); the step's graph is inconsistent: "
                "build the step again") from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProgramResult, (self.program, dict(self), self.stub))

    def __repr__(self) -> str:
        return (f"ProgramResult({self.program!r}, stub)" if self.stub
                else f"ProgramResult({self.program!r}, {len(self)} values)")


class Export:
    """In an output task's arguments: the value of action `key` from its own worker's
    program result (resolved by the output task, see `dagdiff.runtime.direct.graph`), or
    from the result at index `at` among those the task reads (a window's loss averaged
    over replicas on other workers)."""

    __slots__ = ("key", "at")

    def __init__(self, key: str, at: int = -1) -> None:
        self.key = key
        self.at = at

    def __reduce__(self) -> tuple[Any, ...]:
        return (Export, (self.key, self.at))

    def __repr__(self) -> str:
        return f"Export({self.key!r})" if self.at < 0 else f"Export({self.key!r}, at={self.at})"


class LocalImport:
    """In a program task's arguments, in place of a Dask dependency: the value of Dask key
    `key`, which an earlier program of this worker exports as `export` in its run
    `serial` (a Trainer's new state, read by the next step's program on the same worker).
    The program task then depends on nothing of the step before, so the scheduler sends
    it at once and it starts the moment that program ends here, with no round trip
    through the scheduler in between (`DirectRuntime.take_import`). Another task of the
    step keeps `key` as a Dask dependency, so the value's lineage and lifetime stay
    Dask's."""

    __slots__ = ("key", "serial", "export")

    def __init__(self, key: str, serial: str, export: str) -> None:
        self.key = key
        self.serial = serial
        self.export = export

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocalImport, (self.key, self.serial, self.export))

    def __repr__(self) -> str:
        return f"LocalImport({self.key!r} from run {self.serial!r})"


def _serialize(x: ProgramResult, context: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], list[Any]]:
    from distributed.protocol import serialize

    if x.stub or (context is not None and context.get("recipient") is not None):
        return {"program": x.program, "stub": True}, []
    header, frames = serialize(dict(x), on_error="raise")
    return {"program": x.program, "stub": False, "values": header}, frames


def _deserialize(header: dict[str, Any], frames: list[Any]) -> ProgramResult:
    from distributed.protocol import deserialize

    if header["stub"]:
        return ProgramResult(header["program"], stub=True)
    return ProgramResult(header["program"], deserialize(header["values"], frames))


def _sizeof(x: ProgramResult) -> int:
    from dask.sizeof import sizeof

    return 64 + sum(int(sizeof(v)) for v in dict.values(x))


def register() -> None:
    """Register the wire form (a stub to another worker) and the true `sizeof`."""
    from dask.sizeof import sizeof
    from distributed.protocol import dask_deserialize, dask_serialize

    sizeof.register(ProgramResult)(_sizeof)
    dask_serialize.register(ProgramResult)(_serialize)
    dask_deserialize.register(ProgramResult)(_deserialize)
