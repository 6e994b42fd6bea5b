"""What a stage holds: its parameters, and what one live microbatch keeps from its
forward to its backward under each recomputation policy (from the traced avals).

A live microbatch of a stage keeps, until its backward has run: the values it received
(its inputs that are not parameters), the outputs of its layer calls (a forward task's
value is held until its VJP task has read it), and the residuals of each call's
pullback that are not its own inputs, which is what a recomputation policy changes
(`dagdiff.core.remat`): none are kept under ``"full"``, the products without batch
dimensions under ``"selective"``. The residuals are read off `jax.vjp` under
`jax.eval_shape`, the same function the forward task runs, so nothing is computed.

A split backward (zero-bubble schedules) holds more from its I to its W: the output
cotangents W's task reads, and what `dagdiff.core.split` carries from one part to the
other, read off the very partition the workers make (of the backward traced from
abstract values, so again nothing is computed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .remat import POLICIES, with_policy, without_policy
from .spec import CallSpec
from .split import partition
from .tracer import Trace, Traced, aval_of, home_stages


__all__ = ["StageFootprint", "nbytes", "itemsize", "residual_bytes", "carry_bytes",
           "stage_footprints", "recompute_shares"]


def nbytes(aval: Any) -> int:
    """Bytes of one array of `aval`'s shape and dtype."""
    return int(np.prod(aval.shape, dtype=np.int64)) * itemsize(aval.dtype)


def itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype`, JAX's extended dtypes too (a typed PRNG key's
    ``key<fry>``, which NumPy cannot read: an optimizer state or an Equinox module can
    hold one)."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0) or 0)


@dataclass(frozen=True)
class StageFootprint:
    """One stage's bytes: ``params`` (its differentiated parameters; the gradient
    accumulator is as large), ``kept`` (per policy name: what one live microbatch keeps
    from its forward to its backward), ``output`` (the activations it sends on, per
    microbatch: the cotangent that comes back is as large), ``stash`` (per policy: what
    a split backward's I leaves held for its W beside the pullback: the cotangents of
    the calls' outputs, which W's task reads too, and the values the partition carries
    from I to W; a stage without I, whose input is data, holds the cotangents from
    their arrival to its W), ``inputs`` (one microbatch of the batch inputs it reads: a
    step holds the whole batch on the stage's worker, each microbatch a view of it),
    ``received`` (the activations a microbatch brings from earlier stages: part of
    ``kept``, and all a forward fused with its backward keeps of them until its VJP
    task has run), ``returned`` (the cotangents of those its backward computes and
    sends back: a B task's result holds them beside the weight gradients until the
    accumulation has read it), ``fused_stash`` (per policy, for a stage whose last call
    can run its forward with its I (the loss's): what that call carries to its W, or
    None where its backward cannot be split and the forward computes every gradient)."""

    stage: int
    params: int
    kept: tuple[tuple[str, int], ...]
    output: int
    stash: tuple[tuple[str, int], ...] = ()
    inputs: int = 0
    received: int = 0
    returned: int = 0
    fused_stash: tuple[tuple[str, int | None], ...] = ()

    def kept_by(self, policy: str) -> int:
        return dict(self.kept)[policy]

    def stash_by(self, policy: str) -> int:
        return dict(self.stash).get(policy, 0)

    def fused_stash_by(self, policy: str) -> int | None:
        return dict(self.fused_stash).get(policy)


def residual_bytes(spec: CallSpec, avals: list[Any]) -> int:
    """Bytes of the residuals `spec`'s pullback keeps beyond the call's own inputs (the
    forward task's ``fwd_res``), for dynamic inputs of `avals`; 0 when the call
    recomputes (``remat``) or has hand-written rules."""
    if spec.remat or getattr(spec.layer, "custom", False) or not any(spec.diff):
        return 0
    hit = _RESIDUALS.get(spec.fingerprint)   # the fingerprint names the input avals too
    if hit is None:
        hit = _RESIDUALS[spec.fingerprint] = _residual_bytes(spec, avals)
        while len(_RESIDUALS) > 4096:
            _RESIDUALS.pop(next(iter(_RESIDUALS)))
    return hit


#: residual bytes per spec fingerprint (a build checks them every template miss)
_RESIDUALS: dict[str, int] = {}


def _residual_bytes(spec: CallSpec, avals: list[Any]) -> int:
    d = [a for a, f in zip(avals, spec.diff) if f]
    nd = [a for a, f in zip(avals, spec.diff) if not f]

    def kept(d: list[Any], nd: list[Any]) -> list[Any]:
        def primal(*dd: Any) -> list[Any]:
            di, ni = iter(dd), iter(nd)
            return jax.tree_util.tree_leaves(
                spec.call([next(di) if f else next(ni) for f in spec.diff]))

        _, pb = jax.vjp(primal, *d)
        ins = [*d, *nd]
        out, seen = [], set()
        for leaf in jax.tree_util.tree_leaves(pb):
            if any(leaf is a for a in ins) or id(leaf) in seen:
                continue
            seen.add(id(leaf))
            out.append(leaf)
        return out

    try:
        shapes = jax.eval_shape(kept, d, nd)
    except Exception:                       # noqa: BLE001 - a layer eval_shape cannot trace
        return 0
    return sum(nbytes(s) for s in shapes if hasattr(s, "shape"))


def carry_bytes(spec: CallSpec, avals: list[Any], first: tuple[int, ...],
                second: tuple[int, ...], cts: tuple[bool, ...], fused: bool) -> int | None:
    """Bytes of what `dagdiff.core.split` carries from a split backward's I (the
    gradients of differentiated inputs `first`) to its W (those of `second`), for
    dynamic inputs of `avals` and cotangents on the outputs flagged in `cts`: the
    intermediate values the first part computes and the second reads, as the workers
    cut them (`runtime.compiled`: the backward traced from the pullback's leaves, or,
    `fused`, the forward and backward of a call run with its I). None where the
    backward cannot be cut (no shared work, a nested call such as ``jax.checkpoint``'s,
    a call that recomputes or has hand-written rules): I and W then run apart and
    nothing is carried."""
    if spec.remat or getattr(spec.layer, "custom", False) or not first or not second:
        return None
    key = (spec.fingerprint, first, second, cts, fused)
    if key not in _CARRY:
        try:
            _CARRY[key] = _carry_bytes(spec, avals, first, second, cts, fused)
        except Exception:                   # noqa: BLE001 - jax internals differ: no split
            _CARRY[key] = None
        while len(_CARRY) > 4096:
            _CARRY.pop(next(iter(_CARRY)))
    return _CARRY[key]


#: carried bytes per (fingerprint, I's inputs, W's inputs, cotangents, fused)
_CARRY: dict[tuple[Any, ...], int | None] = {}


def _carry_bytes(spec: CallSpec, avals: list[Any], first: tuple[int, ...],
                 second: tuple[int, ...], cts: tuple[bool, ...], fused: bool) -> int | None:
    d = [a for a, f in zip(avals, spec.diff) if f]
    nd = [a for a, f in zip(avals, spec.diff) if not f]
    outs = spec.out_avals
    ct_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a, c in zip(outs, cts) if c]
    c_tree = jax.tree_util.tree_structure([0 if c else None for c in cts])

    def primal(d: Any, nd: Any) -> list[Any]:
        di, ni = iter(d), iter(nd)
        return jax.tree_util.tree_leaves(spec.call([next(di) if f else next(ni)
                                                    for f in spec.diff]))

    def full_ct(cl: list[Any]) -> list[Any]:        # as `runtime.compiled` fills them
        given = jax.tree_util.tree_unflatten(c_tree, cl)
        return [c if c is not None else
                jnp.zeros(a.shape, a.dtype) if jnp.issubdtype(a.dtype, np.inexact) else
                np.zeros(a.shape, jax.dtypes.float0) for c, a in zip(given, outs)]

    if fused:                           # `fwd_grad_split`: outputs, I's, then W's
        def whole(dl: list[Any], nl: list[Any], cl: list[Any]) -> list[Any]:
            out, pb = jax.vjp(lambda *dd: primal(dd, nl), *dl)
            g = pb(full_ct(cl))
            return [*out, *(g[i] for i in first), *(g[i] for i in second)]

        closed = jax.make_jaxpr(whole)(d, nd, ct_avals)
        n_first = len(outs) + len(first)
    else:                               # `split_bwd`: from the pullback's leaves
        box: dict[str, Any] = {}

        def leaves(d: list[Any], nd: list[Any]) -> list[Any]:
            _, pb = jax.vjp(lambda *dd: primal(dd, nd), *d)
            flat, box["tree"] = jax.tree_util.tree_flatten(pb)
            return flat

        p_avals = jax.eval_shape(leaves, d, nd)

        def whole(pl: list[Any], cl: list[Any]) -> list[Any]:
            g = jax.tree_util.tree_unflatten(box["tree"], pl)(full_ct(cl))
            return [*(g[i] for i in first), *(g[i] for i in second)]

        closed = jax.make_jaxpr(whole)(p_avals, ct_avals)
        n_first = len(first)
    if len(closed.jaxpr.outvars) != n_first + len(second):
        return None
    parts = partition(closed, n_first)
    if parts is None:
        return None
    return sum(nbytes(v.aval) for v in parts.jaxprs[0].jaxpr.outvars[n_first:])


def stage_footprints(trace: Trace, policies: tuple[str, ...] = POLICIES
                     ) -> dict[int, StageFootprint]:
    """Per stage of `trace` (stages, runs fused or not): its `StageFootprint`, the
    residuals and a split backward's stash worked out for each of `policies` (applied
    on top of the layers' own ``remat``, to each call as it was before a build gave it
    its stage's policy)."""
    params: dict[int, int] = {}
    for node, stage in home_stages(trace).items():
        if stage is not None and trace.nodes[node].kind == "param":
            params[stage] = params.get(stage, 0) + nbytes(trace.nodes[node].out_avals[0])
    base: dict[int, int] = {}           # inputs received + outputs of its calls
    outs: dict[int, int] = {}
    res: dict[int, dict[str, int]] = {}
    stash: dict[int, dict[str, int]] = {}
    fstash: dict[int, dict[str, int | None]] = {}
    batch: dict[int, int] = {}
    recv: dict[int, int] = {}
    back: dict[int, int] = {}
    seen: set[tuple[int, int, int]] = set()
    read_by: dict[tuple[int, int], set[int | None]] = {}     # value -> stages reading it
    has_ct: set[tuple[int, int]] = set()     # values a VJP gives a cotangent
    for n in trace.nodes:
        if n.kind == "call":
            for pos, x in n.traced_inputs:
                read_by.setdefault((x.node, x.leaf), set()).add(n.stage)
                if n.spec.diff[pos]:
                    has_ct.add((x.node, x.leaf))
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None:
            continue
        g = n.stage
        for pos, x in n.traced_inputs:
            src = trace.nodes[x.node]
            if src.kind == "param" or (src.kind == "call" and src.stage == g):
                continue
            if (x.node, x.leaf, g) not in seen:
                seen.add((x.node, x.leaf, g))
                if src.kind == "input":           # a view of the batch the step holds
                    batch[g] = batch.get(g, 0) + nbytes(x.aval)
                else:
                    base[g] = base.get(g, 0) + nbytes(x.aval)
                    recv[g] = recv.get(g, 0) + nbytes(x.aval)
                    if n.spec.diff[pos]:          # its cotangent goes back
                        back[g] = back.get(g, 0) + nbytes(x.aval)
        for leaf, aval in enumerate(n.out_avals):
            base[g] = base.get(g, 0) + nbytes(aval)
            if read_by.get((n.index, leaf), set()) - {None, g}:
                outs[g] = outs.get(g, 0) + nbytes(aval)
        avals = [x.aval if isinstance(x, Traced) else aval_of(x)
                 for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
        spec = without_policy(n.spec)        # the residuals of each policy, from scratch
        per = res.setdefault(g, {})
        for policy in policies:
            per[policy] = per.get(policy, 0) + residual_bytes(with_policy(spec, policy), avals)
        # a split backward: I w.r.t. the activations, W w.r.t. the parameters (`lower`)
        dyn = [x for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
        is_param = [isinstance(x, Traced) and trace.nodes[x.node].kind == "param"
                    for x, f in zip(dyn, n.spec.diff) if f]
        first = tuple(j for j, q in enumerate(is_param) if not q)
        second = tuple(j for j, q in enumerate(is_param) if q)
        terminal = not any((n.index, leaf) in read_by for leaf in range(len(n.out_avals)))
        # the cotangents W's task reads (the loss's seed is a constant of the graph)
        cts = tuple((n.index, leaf) in has_ct for leaf in range(len(n.out_avals)))
        ct_bytes = sum(nbytes(a) for a, c in zip(n.out_avals, cts) if c) if second else 0
        seeds = tuple(terminal and jnp.issubdtype(a.dtype, np.inexact) for a in n.out_avals)
        per_s = stash.setdefault(g, {})
        for policy in policies:
            sp = with_policy(spec, policy)
            given = tuple(c or e for c, e in zip(cts, seeds))
            carry = carry_bytes(sp, avals, first, second, given, False) if any(given) else None
            per_s[policy] = per_s.get(policy, 0) + ct_bytes + (carry or 0)
            if terminal and any(seeds):      # the loss's call: F and I may run as one
                fc = carry_bytes(sp, avals, first, second, seeds, True)
                had = fstash.setdefault(g, {}).get(policy, 0)
                fstash[g][policy] = None if fc is None or had is None else had + fc
    stages = sorted(set(base) | set(params))
    return {g: StageFootprint(g, params.get(g, 0),
                              tuple((p, base.get(g, 0) + res.get(g, {}).get(p, 0))
                                    for p in policies), outs.get(g, 0),
                              tuple((p, stash.get(g, {}).get(p, 0)) for p in policies),
                              batch.get(g, 0), recv.get(g, 0), back.get(g, 0),
                              tuple(fstash[g].items()) if g in fstash else ())
            for g in stages}


def _work(fn: Any, *avals: Any) -> float:
    """XLA's estimate of `fn`'s work on `avals`: flops plus transcendentals (tanh, exp
    cost as much as a multiply-add here, roughly what a CPU or GPU pays)."""
    ca = jax.jit(fn).lower(*avals).cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float((ca or {}).get("flops", 0.0)) + float((ca or {}).get("transcendentals", 0.0))


def _backward_work(spec: CallSpec, avals: list[Any]) -> tuple[float, float]:
    """(forward work, forward+backward work) of `spec` as `jax.vjp` runs it."""
    d = [a for a, f in zip(avals, spec.diff) if f]
    nd = [a for a, f in zip(avals, spec.diff) if not f]

    def primal(d: list[Any], nd: list[Any]) -> list[Any]:
        di, ni = iter(d), iter(nd)
        return jax.tree_util.tree_leaves(spec.call([next(di) if f else next(ni)
                                                    for f in spec.diff]))

    outs = jax.eval_shape(primal, d, nd)

    def both(d: list[Any], nd: list[Any], cts: list[Any]) -> Any:
        _, pb = jax.vjp(lambda *dd: primal(list(dd), nd), *d)
        return pb(cts)

    cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    return _work(primal, d, nd), _work(both, d, nd, cts)


def recompute_shares(trace: Trace, policies: tuple[str, ...] = ("selective",)
                     ) -> dict[int, dict[str, float]]:
    """Per stage and policy: the share of the stage's forward work its backward runs
    again (XLA's cost estimate of the backward under the policy less that without it,
    over the forward's). ``"full"`` is 1 by construction (the forward runs again)."""
    fwd: dict[int, float] = {}
    extra: dict[int, dict[str, float]] = {}
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None or not any(n.spec.diff) \
                or getattr(n.spec.layer, "custom", False):
            continue
        avals = [x.aval if isinstance(x, Traced) else aval_of(x)
                 for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
        try:
            f0, b0 = _backward_work(n.spec, avals)
            per = extra.setdefault(n.stage, {})
            for policy in policies:
                _, b1 = _backward_work(with_policy(n.spec, policy), avals) \
                    if policy != "full" else (0.0, b0 + f0)
                per[policy] = per.get(policy, 0.0) + max(b1 - b0, 0.0)
        except Exception:                  # noqa: BLE001 - no estimate for this call
            continue
        fwd[n.stage] = fwd.get(n.stage, 0.0) + f0
    return {g: {p: min(1.0, v / fwd[g]) if fwd.get(g) else 0.0 for p, v in per.items()}
            for g, per in extra.items()}
