"""The program of one worker in one step: its actions in run order (the plan's
`PlannedAction`s bound to their tasks and addresses), the step's inputs it reads and its
peers (a frozen record, built by `graph.rewrite` from the pure `plan`, run by
`run.ProgramRun`).

Steps bound from one template (`dagdiff.lowering.template`) share their programs' bodies
(everything but the program's key and step token), and a body is the bulk of a step's
graph (each action's task: ~10 KB, ~0.5 ms to pickle for the tiny job's worker). So a
template's program (`shared`: its tasks hold the keys of Futures, not Futures, so a cached
body keeps no data alive) pickles as its key, its step and its body's id and bytes, the
bytes made once per body and process; a process that unpickles a body id it has seen
reuses that body without reading the bytes (`Program.__reduce__`; both caches bounded,
`BODY_CACHE_*`). Any other program pickles whole.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from typing import Any

from distributed.protocol.pickle import dumps, loads

from .plan import PlannedAction


__all__ = ["Program", "BODY_CACHE_ENTRIES", "BODY_CACHE_BYTES", "body_cache_stats"]

#: bodies each cache keeps (least recently used dropped first), and their bytes at most
BODY_CACHE_ENTRIES = 512
BODY_CACHE_BYTES = 256 * 2**20


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
    #: a template's program (`dagdiff.lowering.template`): its body is pickled once
    shared: bool = False
    #: the token of the step a template's actions were built for (their keys carry it),
    #: when this program is that template bound to step `step` ("": the keys are its own)
    origin: str = ""

    def own_key(self, key: str) -> str:
        """An action's key as this step's own graph would name it (`origin` -> `step`):
        what the action log and the dashboard report."""
        if not self.origin:
            return key
        return key.replace(self.origin, self.step).replace(self.origin[:12], self.step[:12])

    def address_of(self, where: str) -> str:
        for w, address in self.members:
            if w == where:
                return address
        return where

    def __reduce__(self) -> tuple[Any, ...]:
        if not self.shared:
            return Program, (self.key, self.step, *self._body())
        body_id, blob = _BODIES.pickled(self._body())
        return _program, (self.key, self.step, body_id, blob, self.origin)

    def _body(self) -> tuple[Any, ...]:
        return (self.where, self.address, self.actions, self.statics, self.timeout,
                self.members, self.live)


def _program(key: str, step: str, body_id: str, blob: bytes, origin: str = "") -> Program:
    """Unpickle a `Program` (see `Program.__reduce__`)."""
    return Program(key, step, *_BODIES.body(body_id, blob), shared=True, origin=origin)


class _BodyCache:
    """Pickled bodies by the identity of their actions (the sending side), and bodies by
    id (the receiving side: a process that forwards a program, such as the scheduler,
    sends the id and bytes it received)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: id(actions) -> (body, body id, bytes); the body holds the actions alive
        self._sent: collections.OrderedDict[int, tuple[tuple[Any, ...], str, bytes]] = \
            collections.OrderedDict()
        self._by_id: collections.OrderedDict[str, tuple[tuple[Any, ...], int]] = \
            collections.OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def pickled(self, body: tuple[Any, ...]) -> tuple[str, bytes]:
        with self._lock:
            entry = self._sent.get(id(body[2]))
            if entry is not None and _same(entry[0], body):
                self._sent.move_to_end(id(body[2]))
                self.hits += 1
                return entry[1], entry[2]
        # distributed's pickle: objects of `__main__` (a notebook's classes) by value
        blob = dumps(body)
        body_id = uuid.uuid4().hex
        with self._lock:
            self.misses += 1
            self._remember(body_id, body, blob)
        return body_id, blob

    def body(self, body_id: str, blob: bytes) -> tuple[Any, ...]:
        with self._lock:
            entry = self._by_id.get(body_id)
            if entry is not None:
                self._by_id.move_to_end(body_id)
                self.hits += 1
                return entry[0]
        body = loads(blob)
        with self._lock:
            self.misses += 1
            self._remember(body_id, body, blob)
        return body

    def _remember(self, body_id: str, body: tuple[Any, ...], blob: bytes) -> None:
        old = self._sent.pop(id(body[2]), None)
        if old is not None:
            self._forget(old[1])
        self._sent[id(body[2])] = (body, body_id, blob)
        self._by_id[body_id] = (body, len(blob))
        self._bytes += len(blob)
        while self._by_id and (len(self._by_id) > BODY_CACHE_ENTRIES
                               or self._bytes > BODY_CACHE_BYTES):
            oldest = next(iter(self._by_id))
            self._forget(oldest)

    def _forget(self, body_id: str) -> None:
        entry = self._by_id.pop(body_id, None)
        if entry is None:
            return
        self._bytes -= entry[1]
        sent = self._sent.get(id(entry[0][2]))
        if sent is not None and sent[1] == body_id:
            del self._sent[id(entry[0][2])]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bodies": len(self._by_id), "bytes": self._bytes, "hits": self.hits,
                    "misses": self.misses}


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two bodies with the same actions object are the same body (the rest compared)."""
    return all(x is y or x == y for x, y in zip(a, b))


_BODIES = _BodyCache()


def body_cache_stats() -> dict[str, int]:
    """This process's program-body cache: bodies kept, their bytes, hits and misses."""
    return _BODIES.stats()
