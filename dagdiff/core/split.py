"""A split backward that shares its work: input gradients (I) first, weight gradients (W)
later from what I already computed (zero-bubble schedules).

ZB schedules run a layer call's backward as two tasks: I (the cotangents of its
activation inputs, on the critical path) and W (its parameter gradients, deferred into
the bubbles). Computed independently, both walk the same chain of cotangents through
the call: for a stack of dense layers W repeats all of I's matrix products, and I + W
cost ~1.3-1.6x one fused backward. `partition` cuts the backward's jaxpr in two instead:
part one computes I's outputs plus the intermediate values W still needs (the *carry*,
e.g. each layer's pre-activation cotangent), part two only what is left for W. Their
sum costs what one backward does.

Only plain primitive equations are split; a backward with effects, or whose shared
work sits inside a nested call (an inner ``jax.jit``, a scan), is left to the
independent I and W (`partition` returns None), as is one where I and W share nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore


__all__ = ["SplitBackward", "partition"]


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """The two jitted parts of one traced function (a backward, or a forward and its
    backward), cut after its first `n_first` outputs.

    ``run_first(inputs)`` gives those outputs and a *stash*: the inputs and intermediate
    values the rest still reads (references, no copies); ``run_second(stash)`` gives the
    remaining outputs. `inputs`: the flat arguments the function was traced with."""

    first: Callable[..., Sequence[Any]]
    second: Callable[..., Sequence[Any]]
    n_first: int                       # outputs at the front of first's results
    kept: tuple[int, ...]              # the inputs `second` reads again
    n_carry: int                       # intermediate values passed from first to second
    jaxprs: tuple[Any, Any]            # the two parts (ClosedJaxpr), to inspect

    def run_first(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        out = self.first(*inputs)
        return (tuple(out[:self.n_first]),
                (*(inputs[i] for i in self.kept), *out[self.n_first:]))

    def run_second(self, stash: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self.second(*stash))


def _renamed(info: Any) -> Any:
    """The traced function's debug info without its argument names and result paths,
    which no longer match the parts' (jax checks their counts under jax_enable_checks)."""
    replace = getattr(info, "_replace", None)
    return replace(arg_names=None, result_paths=None) if replace is not None else None


def _needed(jaxpr: Any, targets: Sequence[Any]) -> set[int]:
    """Indices of the equations `targets` (atoms of `jaxpr`) depend on."""
    need = {v for v in targets if isinstance(v, jcore.Var)}
    out: set[int] = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(not isinstance(o, jcore.DropVar) and o in need for o in eqn.outvars):
            out.add(i)
            need.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return out


def partition(closed: Any, n_first: int) -> SplitBackward | None:
    """Cut `closed` (a ClosedJaxpr whose outputs are the first group's gradients, then
    the second group's) into two jitted parts that share its work; None when there is
    nothing to share or the jaxpr cannot be cut safely."""
    jaxpr = closed.jaxpr
    if jaxpr.effects or not 0 < n_first < len(jaxpr.outvars):
        return None
    head, tail = list(jaxpr.outvars[:n_first]), list(jaxpr.outvars[n_first:])
    one = _needed(jaxpr, head)
    two = _needed(jaxpr, tail)
    shared = one & two
    if not shared:
        return None
    if any(next(iter(jcore.jaxprs_in_params(jaxpr.eqns[i].params)), None) is not None
           for i in shared):
        return None                     # a nested call computes both: keep them apart
    rest = [i for i in range(len(jaxpr.eqns)) if i in two and i not in one]
    reads = {v for i in rest for v in jaxpr.eqns[i].invars if isinstance(v, jcore.Var)}
    reads.update(v for v in tail if isinstance(v, jcore.Var))
    carry, seen = [], set()
    for i in sorted(one):
        for v in jaxpr.eqns[i].outvars:
            if not isinstance(v, jcore.DropVar) and v in reads and v not in seen:
                seen.add(v)
                carry.append(v)
    kept = tuple(i for i, v in enumerate(jaxpr.invars) if v in reads)
    info = _renamed(jaxpr.debug_info)
    part_one = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, head + carry,
                           [jaxpr.eqns[i] for i in sorted(one)], jaxpr.effects, info)
    part_two = jcore.Jaxpr(jaxpr.constvars, [jaxpr.invars[i] for i in kept] + carry, tail,
                           [jaxpr.eqns[i] for i in rest], jaxpr.effects, info)
    one_c = jcore.ClosedJaxpr(part_one, closed.consts)
    two_c = jcore.ClosedJaxpr(part_two, closed.consts)
    return SplitBackward(jax.jit(jcore.jaxpr_as_fun(one_c)), jax.jit(jcore.jaxpr_as_fun(two_c)),
                         n_first, kept, len(carry), (one_c, two_c))
