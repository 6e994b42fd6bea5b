"""Readable, deterministic Dask task keys, and `key_info` to decode them.

A key reads ``{prefix}_{name}-s{stage}-m{microbatch}-n{index}-{token}``; the stage
and microbatch parts are left out where they do not apply. ``dask.utils.key_split``
of such a key is ``{prefix}_{name}`` (e.g. ``fwd_dense``), which is what the Dask
dashboard shows as the task prefix.
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple

from ..errors import KeyFormatError


__all__ = ["KeyInfo", "key_info", "make_key", "sanitize", "PHASES"]

#: key prefix -> phase reported by `key_info`
PHASES: dict[str, str] = {
    "fwd": "F",
    "vjp": "B",
    "igrad": "I",
    "wgrad": "W",
    "add": "add",
    "grad": "grad",
    "acc": "acc",
    "param": "param",
    "input": "input",
    "loss": "loss",
    "aux": "aux",
    "split": "split",
    "update": "update",
    "reduce": "reduce",
    "state": "state",
    "done": "done",
    "prog": "program",
    "outs": "outputs",
    "run": "run",
    "backup": "backup",
}
_PREFIX = {v: k for k, v in PHASES.items()}

_KEY_RE = re.compile(
    r"^(?P<prefix>[a-z]+)_(?P<name>[A-Za-z0-9_]*)"
    r"(?:-s(?P<stage>\d+))?(?:-m(?P<mb>\d+))?-n(?P<index>\d+)(?:-o(?P<out>\d+))?"
    r"-(?P<token>[0-9a-f]+)$"
)
_BAD = re.compile(r"[^A-Za-z0-9_]")


class KeyInfo(NamedTuple):
    """What a dagdiff key says: phase (F, B, I, W, add, grad, ...), layer, stage, microbatch."""

    phase: str
    layer: str | None
    stage: int | None
    microbatch: int | None


@functools.lru_cache(maxsize=4096)
def sanitize(name: str) -> str:
    """Make `name` safe for a key: letters, digits and '_' only, starting with a letter."""
    out = re.sub("_+", "_", _BAD.sub("_", str(name))).strip("_") or "anon"
    return out if out[0].isalpha() else "l" + out


def make_key(
    phase: str,
    name: str,
    index: int,
    token: str,
    stage: int | None = None,
    microbatch: int | None = None,
    out: int | None = None,
) -> str:
    """Build the key of one task; `phase` is a `PHASES` value or prefix (``"F"`` or ``"fwd"``)."""
    prefix = _PREFIX.get(phase, phase)
    if prefix not in PHASES:
        raise KeyFormatError(f"unknown phase {phase!r}; use one of {sorted(PHASES)}")
    parts = [f"{prefix}_{sanitize(name)}"]
    if stage is not None:
        parts.append(f"s{stage}")
    if microbatch is not None:
        parts.append(f"m{microbatch}")
    parts.append(f"n{index}")
    if out:
        parts.append(f"o{out}")
    parts.append(token)
    return "-".join(parts)


def key_info(key: object) -> KeyInfo:
    """Decode a dagdiff task key into ``KeyInfo(phase, layer, stage, microbatch)``.

    Raises `KeyFormatError` (a `ValueError`) for keys dagdiff did not make.
    """
    if isinstance(key, tuple) and key:
        key = key[0]
    if isinstance(key, bytes):
        key = key.decode()
    m = _KEY_RE.match(key) if isinstance(key, str) else None
    if m is None or m["prefix"] not in PHASES:
        raise KeyFormatError(
            f"{key!r} is not a dagdiff task key "
            "(expected 'fwd_<layer>-s<stage>-m<mb>-n<i>-<token>')"
        )
    stage = m["stage"]
    mb = m["mb"]
    return KeyInfo(
        PHASES[m["prefix"]],
        m["name"] or None,
        int(stage) if stage is not None else None,
        int(mb) if mb is not None else None,
    )
