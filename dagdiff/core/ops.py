"""Operators on traced values (+, -, *, /, @, **, unary -, .T, indexing), each recorded
as a small layer, so glue code between layers needs no `dd.layer` of its own."""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..errors import TracerError
from .layer import Layer
from .tracer import OPERATORS


__all__ = ["getitem", "OPERATOR_LAYERS"]


class _Index:
    """A hashable, static form of an indexing expression (slices are unhashable before 3.12)."""

    __slots__ = ("enc",)

    def __init__(self, enc: Any) -> None:
        self.enc = enc

    @staticmethod
    def encode(index: Any) -> "_Index":
        def enc(i: Any) -> Any:
            if isinstance(i, slice):
                return ("slice", i.start, i.stop, i.step)
            if isinstance(i, tuple):
                return ("tuple", *map(enc, i))
            if i is None or i is Ellipsis or isinstance(i, (int, np.integer)):
                return ("v", i if not isinstance(i, np.integer) else int(i))
            raise TracerError(
                f"indexing a traced value supports ints, slices, None and Ellipsis, got {i!r}; "
                "do fancy indexing inside a dd.layer"
            )
        return _Index(enc(index))

    def decode(self) -> Any:
        def dec(e: Any) -> Any:
            if e[0] == "slice":
                return slice(*e[1:])
            if e[0] == "tuple":
                return tuple(dec(x) for x in e[1:])
            return e[1]
        return dec(self.enc)

    def __hash__(self) -> int:
        return hash(self.enc)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Index) and other.enc == self.enc

    def __repr__(self) -> str:
        return f"[{self.decode()!r}]"

    def __reduce__(self) -> Any:
        return (_Index, (self.enc,))


def _getitem(x: Any, index: _Index) -> Any:
    return x[index.decode()]


def _transpose(x: Any) -> Any:
    return x.T


_GETITEM = Layer(_getitem, name="getitem")


def getitem(x: Any, index: Any) -> Any:
    """``x[index]`` of a traced value: a static index (ints, slices, None, Ellipsis)."""
    return _GETITEM(x, _Index.encode(index))


OPERATORS.update({name: Layer(getattr(operator, name), name=name)
                  for name in ("add", "sub", "mul", "truediv", "matmul", "pow")})
OPERATORS.update(neg=Layer(operator.neg, name="neg"),
                 transpose=Layer(_transpose, name="transpose"), getitem=getitem)

#: the layers recorded for operators and indexing on traced values (not the user's)
OPERATOR_LAYERS: frozenset[Layer] = frozenset(
    [_GETITEM, *(v for v in OPERATORS.values() if isinstance(v, Layer))])
